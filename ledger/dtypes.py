"""Bytes per element of the dtypes the ledgers speak about: the one home of these sizes."""
BF16, FP32, FP64, INT64 = 2, 4, 8, 8
BYTES = {"fp32": FP32, "float32": FP32, "bf16": BF16, "bfloat16": BF16, "fp16": 2, "float16": 2, "uint8": 1,
         "int64": INT64, "int32": 4, "fp64": FP64, "float64": FP64}


def nbytes(dtype: str) -> int:
    try:
        return BYTES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype!r} unknown; known: {sorted(BYTES)}") from None
