"""CPU import-only stand-in for ``sgl_kernel`` (see ragen_mega/backends/sglang/cpu_standins)."""
from _cpu_standin import missing_attribute, standin_function

_NAMES = (
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
)
globals().update({name: standin_function(f"sgl_kernel.{name}") for name in _NAMES})
__getattr__ = missing_attribute(__name__)
