"""What tools/generate_kernels.py and tools/generate_bwd_kernels.py share: the head-dim and dtype
lists, the file stem the build and the dispatch match on, and writing src/instantiations/."""

import argparse
import pathlib

HEAD_DIMS = [(64, 64), (96, 96), (128, 128), (192, 192), (192, 128), (256, 256)]
DTYPES = {"fp16": "cutlass::half_t", "bf16": "cutlass::bfloat16_t"}


def stem(direction, hdim, hdim_v, dtype, feature):
    """flash_{direction}_hdim{D}[x{Dv}]_{dtype}[_{feature}]_sm90."""
    dims = f"{hdim}" if hdim == hdim_v else f"{hdim}x{hdim_v}"
    suffix = f"_{feature}" if feature else ""
    return f"flash_{direction}_hdim{dims}_{dtype}{suffix}_sm90"


def write_instantiations(description, direction, features, render):
    """Replaces the flash_{direction}_*_sm90.cu files under --out with one per head-dim pair,
    dtype and feature; render(stem, element, hdim, hdim_v, feature_value) gives a file's text."""
    parser = argparse.ArgumentParser(description=description)
    root = pathlib.Path(__file__).resolve().parent.parent
    parser.add_argument("--out", type=pathlib.Path, default=root / "src" / "instantiations")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for old in args.out.glob(f"flash_{direction}_*_sm90.cu"):
        old.unlink()
    for hdim, hdim_v in HEAD_DIMS:
        for dtype, element in DTYPES.items():
            for feature, value in features.items():
                name = stem(direction, hdim, hdim_v, dtype, feature)
                (args.out / f"{name}.cu").write_text(render(name, element, hdim, hdim_v, value))
