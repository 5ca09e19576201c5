"""Copies of the bundled model in other GGUF types, for cost curves per format (issues 22 and 28).

The bundled file is Q4_1; llama.cpp's own quantizer (`models.llamacpp.quantize`, requantizing)
writes Q4_0, Q8_0 and Q4_K_M copies of it. Requantized weights are a little worse than weights
quantized from float, which does not matter for timing.

    python benchmarks/format_copies.py --out /tmp/formats
    specsample bench cost-curve --model /tmp/formats/SmolLM2-135M-Instruct.Q8_0.gguf --backends gguf,llamacpp,fast
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specsample.models.llamacpp import default_threads, quantize
from specsample.models.loading import bundled_gguf

TYPES = ("Q4_0", "Q8_0", "Q4_K_M")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--types", default=",".join(TYPES))
    args = parser.parse_args()
    source = bundled_gguf()
    for type_name in args.types.split(","):
        out = args.out / f"SmolLM2-135M-Instruct.{type_name}.gguf"
        if not out.is_file():
            quantize(source, out, type_name, default_threads())
        print(out)


if __name__ == "__main__":
    main()
