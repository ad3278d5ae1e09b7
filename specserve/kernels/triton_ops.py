"""Triton kernel entry points that kernels/ops.py dispatches to for CUDA tensors (same signatures and semantics
as kernels/reference.py), plus the accept and context-lookup kernels for speculative/accept.py's and
speculative/ngram.py's dispatch. Each kernel lives in a small file by job; this module only re-exports them."""

from specserve.kernels.triton_accept import accept_greedy_triton, accept_sampling_q_triton, accept_sampling_triton
from specserve.kernels.triton_act import silu_and_mul
from specserve.kernels.triton_candidates import sample_candidates_triton
from specserve.kernels.triton_fp8 import fp8_linear
from specserve.kernels.triton_gdn import causal_conv_states_triton, gated_delta_rule_states_triton
from specserve.kernels.triton_gdn_chunked import causal_conv_prefill_triton, gated_delta_rule_prefill_triton
from specserve.kernels.triton_gdn_gates import gated_rms_norm_triton, gdn_gating_triton
from specserve.kernels.triton_gemv import gemv, norm_gemv, norm_gemv_rope_store, rope_store_config
from specserve.kernels.triton_kv import store_kv
from specserve.kernels.triton_moe import fused_moe
from specserve.kernels.triton_ngram import lookup_drafts_triton
from specserve.kernels.triton_norm import add_rms_norm, rms_norm
from specserve.kernels.triton_qk_prep import qk_norm_rope_store_triton
from specserve.kernels.triton_rope import rope
from specserve.kernels.triton_router import (
                                             grouped_router_fits,
                                             grouped_router_topk_triton,
                                             norm_router_topk_triton,
                                             router_topk_triton,
                                             softmax_topk_triton,
)
from specserve.kernels.triton_sample import probs_triton, sample_triton
from specserve.kernels.triton_top1 import row_top1_triton

__all__ = ["accept_greedy_triton", "accept_sampling_q_triton", "accept_sampling_triton", "add_rms_norm",
           "causal_conv_prefill_triton", "causal_conv_states_triton", "fp8_linear", "fused_moe",
           "gated_delta_rule_prefill_triton",
           "gated_delta_rule_states_triton", "gated_rms_norm_triton", "gdn_gating_triton", "gemv",
           "grouped_router_fits", "grouped_router_topk_triton", "lookup_drafts_triton", "norm_gemv",
           "norm_gemv_rope_store", "norm_router_topk_triton", "probs_triton", "qk_norm_rope_store_triton",
           "rms_norm", "rope", "rope_store_config", "router_topk_triton", "row_top1_triton",
           "sample_candidates_triton", "sample_triton", "silu_and_mul", "softmax_topk_triton", "store_kv"]
