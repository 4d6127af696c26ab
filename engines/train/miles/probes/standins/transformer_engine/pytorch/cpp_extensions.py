"""transformer_engine.pytorch.cpp_extensions stand-in: `general_gemm`, as Megatron's router calls it (layout TN:
out = B A^T, inputs as given, accumulation and output in `out_dtype`, plus bias)."""


def general_gemm(A, B, workspace=None, out_dtype=None, layout="TN", out=None, bias=None, **kwargs):
    if layout != "TN" or kwargs.get("accumulate") or kwargs.get("gelu") or kwargs.get("quantization_params"):
        raise NotImplementedError(f"the TransformerEngine stand-in's general_gemm models layout TN only "
                                  f"(got {layout}, {sorted(k for k, v in kwargs.items() if v)})")
    dtype = out_dtype or B.dtype
    result = B.to(dtype) @ A.to(dtype).t()  # TE/cuBLAS: bf16 inputs, fp32 accumulate, `out_dtype` output
    if bias is not None:
        result = result + bias.to(dtype)
    if out is not None:
        out.copy_(result)
        result = out
    return result, None, None, None
