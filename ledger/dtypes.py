"""Bytes per element of the dtypes the ledger speaks about."""
BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "uint8": 1, "int64": 8, "int32": 4}


def nbytes(dtype: str) -> int:
    try:
        return BYTES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype!r} unknown; known: {sorted(BYTES)}") from None
