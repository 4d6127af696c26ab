"""transformer_engine.pytorch.cpp_extensions stand-in: `general_gemm`, as Megatron's router calls it
(moe_utils.py RouterGatingLinearFunction: layout TN in its forward, NN and NT in its backward). TE's layout names
cuBLAS' column-major operands (first letter: A, second: B; T = transposed); in row-major terms out = op_B(B) @
op_A(A) with op_A(A) = A^T for a leading T and op_B(B) = B^T for a trailing T: TN = B A^T (forward), NN = B A
(grad input = grad_out @ weight), NT = B^T A (grad weight = grad_out^T @ input). Inputs as given, accumulation
and output in `out_dtype`, plus bias (forward only)."""

LAYOUTS = ("TN", "NN", "NT")


def general_gemm(A, B, workspace=None, out_dtype=None, layout="TN", out=None, bias=None, **kwargs):
    grad = kwargs.pop("grad", False)
    if layout not in LAYOUTS or kwargs.get("accumulate") or kwargs.get("gelu") or \
            kwargs.get("quantization_params") or (grad and bias is not None):
        raise NotImplementedError(f"the TransformerEngine stand-in's general_gemm models layouts "
                                  f"{'/'.join(LAYOUTS)} without bias gradient only "
                                  f"(got {layout}, {sorted(k for k, v in kwargs.items() if v)}, grad={grad})")
    dtype = out_dtype or B.dtype
    a, b = A.to(dtype), B.to(dtype)  # TE/cuBLAS: bf16 inputs, fp32 accumulate, `out_dtype` output
    result = (b.t() if layout[1] == "T" else b) @ (a.t() if layout[0] == "T" else a)
    if bias is not None:
        result = result + bias.to(dtype)
    if out is not None:
        out.copy_(result)
        result = out
    return result, None, None, None
