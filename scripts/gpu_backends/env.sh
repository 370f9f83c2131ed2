# Sourced on the GPU machine after install.sh: the carried kernels on the path. `pip --target`
# skips the .pth file that puts the CuTe DSL's own packages on sys.path, hence dsl_packages.
export PYTHONPATH=$PWD:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
