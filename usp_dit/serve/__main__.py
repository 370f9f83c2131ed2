"""``torchrun --nproc-per-node N -m usp_dit.serve ...`` (``usp_dit.serve.server``)."""
from usp_dit.serve.server import main

if __name__ == "__main__":
    main()
