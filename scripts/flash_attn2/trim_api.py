"""Trim flash-attn 2.8.3's flash_api.cpp to the kernels of a test build:
head dims 64 and 128, fp16/bf16, non-causal, no split-KV. Anything else raises."""
import re, sys
src = open(sys.argv[1]).read()
fwd_old = src[src.index("void run_mha_fwd(Flash_fwd_params"):src.index("// Find the number of splits")]
fwd_new = '''void run_mha_fwd(Flash_fwd_params &params, cudaStream_t stream, bool force_split_kernel=false) {
    TORCH_CHECK(!params.is_causal && params.num_splits <= 1 && !force_split_kernel,
                "usp_dit test build of flash-attn: causal and split-KV kernels are not compiled");
    TORCH_CHECK(params.d == 64 || params.d == 128, "usp_dit test build of flash-attn: head dims 64 and 128 only");
    FP16_SWITCH(!params.is_bf16, [&] {
        if (params.d == 64) { run_mha_fwd_<elem_type, 64, false>(params, stream); }
        else { run_mha_fwd_<elem_type, 128, false>(params, stream); }
    });
}

'''
bwd_old = src[src.index("void run_mha_bwd(Flash_bwd_params"):src.index("std::vector<at::Tensor>\nmha_bwd(")]
bwd_new = '''void run_mha_bwd(Flash_bwd_params &params, cudaStream_t stream) {
    TORCH_CHECK(!params.is_causal, "usp_dit test build of flash-attn: causal kernels are not compiled");
    TORCH_CHECK(params.d == 64 || params.d == 128, "usp_dit test build of flash-attn: head dims 64 and 128 only");
    FP16_SWITCH(!params.is_bf16, [&] {
        if (params.d == 64) { run_mha_bwd_<elem_type, 64, false>(params, stream); }
        else { run_mha_bwd_<elem_type, 128, false>(params, stream); }
    });
}

'''
heur = "params.num_splits = num_splits_heuristic(batch_size * num_heads * num_m_blocks, num_sm * 2, num_n_blocks, 128);"
assert fwd_old and bwd_old and heur in src
src = src.replace(fwd_old, fwd_new).replace(bwd_old, bwd_new).replace(heur, "params.num_splits = 1;")
open(sys.argv[2], "w").write(src)
