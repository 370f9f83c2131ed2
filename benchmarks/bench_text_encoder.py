"""T5-XXL prompt encoding on one GPU: what each rank pays when every rank encodes its prompt.

    PYTHONPATH=. python3 benchmarks/bench_text_encoder.py --json t5.json

T5-XXL encoder (google/t5-v1_1-xxl's config: d_model 4096, 24 layers, 64 heads, d_ff 10240; the
text encoder of Flux, SD3, CogVideoX, Mochi, LTX) with random weights, bf16, 512 tokens (Flux's
``max_sequence_length``), batch 1 and 2 (a prompt and a negative prompt), ``torch.inference_mode``.
Prints the median encode time over ``--rounds`` and the encoder's weight memory. Broadcasting the
result instead (one rank encodes, the replica receives 512 x 4096 bf16 = 4 MiB per prompt) cannot
be timed on one GPU; docs/PERFORMANCE.md sets the measured encode time beside a datasheet projection
of that broadcast.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              relative_attention_num_buckets=32, feed_forward_proj="gated-gelu", is_encoder_decoder=False)


def main(argv: list[str] | None = None) -> int:
    from transformers import T5Config, T5EncoderModel

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = T5EncoderModel(T5Config(**T5_XXL)).eval()
    torch.set_default_dtype(torch.float32)
    weights_gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    rows = []
    with torch.inference_mode():
        for batch in (1, 2):
            ids = torch.randint(0, 32128, (batch, args.tokens), device=device)
            for _ in range(3):
                model(input_ids=ids)
            times = []
            for _ in range(args.rounds):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = model(input_ids=ids).last_hidden_state
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            rows.append(dict(batch=batch, tokens=args.tokens, encode_ms=round(statistics.median(times), 2),
                             output_mib=round(out.numel() * out.element_size() / 2**20, 2),
                             weights_gib=round(weights_gib, 2)))
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
