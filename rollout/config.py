"""Engine configuration: one frozen dataclass, validated once at construction (mirrored by rollout/conf/engine)."""

from __future__ import annotations

from dataclasses import dataclass, fields

ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash_attn", "fa4")  # fa4: FA4 prefill, Triton decode
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8")  # "auto" = the model's dtype
TP_ALL_REDUCE = ("nccl", "symm_mem")  # the process group's all-reduce; or PyTorch symmetric memory's one-shot


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    block_size: int = 16
    num_blocks: int | None = None  # None = derived (GPU: gpu_memory_utilization; CPU: cpu_kv_cache_gib)
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 1.0
    enable_prefix_caching: bool = True
    async_mode: bool | None = None  # None = on for CUDA, off for CPU
    cuda_graphs: bool | None = None  # None = on for CUDA
    max_graph_batch_size: int = 512  # decode graphs up to min(this, max_num_seqs) sequences
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"  # "fp8": e4m3 with a scale per (token, kv head), ~1.97x bf16's tokens
    seed: int = 0
    tensor_parallel_size: int = 1  # ranks (GPUs) one model is sharded over; 1 = no tensor parallelism
    swap_space_gib: float = 0.0  # pinned host pool for preempted sequences' KV; 0 = off (recompute only)
    tp_all_reduce: str = "nccl"  # "symm_mem": opt-in one-shot all-reduce for decode-sized tensors (CUDA, TP > 1)
    turn_prefill_hold_steps: int = 0  # a conversation's environment reply waits <= this many steps to batch (turns.py)
    turn_rows_max_tokens: int = 0  # an environment reply of <= this many tokens runs as decode rows (graphs); 0 = off
    max_num_rows: int | None = None  # a step's rows (one per sequence, plus replies' rows); None = max_num_seqs
    gemm_autotune: bool = False  # CUDA: time each projection's GEMM methods per decode graph size (layers/gemm_tune.py)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_graph_batch_size"):
            _positive_int(name, getattr(self, name))
        hold = self.turn_prefill_hold_steps
        if isinstance(hold, bool) or not isinstance(hold, int) or not 0 <= hold <= 1024:
            raise ValueError(f"turn_prefill_hold_steps must be an int in [0, 1024], got {hold!r}")
        rows = self.turn_rows_max_tokens
        if isinstance(rows, bool) or not isinstance(rows, int) or not 0 <= rows <= 4096:
            raise ValueError(f"turn_rows_max_tokens must be an int in [0, 4096] (0 = off), got {rows!r}")
        for name in ("max_model_len", "num_blocks", "max_num_rows"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if self.max_num_rows is not None and self.max_num_rows < self.max_num_seqs:
            raise ValueError(f"max_num_rows must be at least max_num_seqs ({self.max_num_seqs}): every running "
                             f"sequence takes a row, got {self.max_num_rows}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("gpu_memory_utilization", "cpu_kv_cache_gib", "swap_space_gib"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {value!r}")
        if not 0.0 < self.cpu_kv_cache_gib < 2**20:
            raise ValueError(f"cpu_kv_cache_gib must be a finite number of GiB in (0, 2**20), "
                             f"got {self.cpu_kv_cache_gib}")
        if not 0.0 <= self.swap_space_gib < 2**20:
            raise ValueError(f"swap_space_gib must be a finite number of GiB in [0, 2**20) (0 = off), "
                             f"got {self.swap_space_gib}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "fp8" and self.attention_backend in ("flash_attn", "fa4"):
            raise ValueError(
                "kv_cache_dtype='fp8' needs attention_backend 'triton', 'torch' or 'auto', "
                f"not {self.attention_backend!r} (it reads no cache with per-token fp8 scales)"
            )
        for name in ("enable_prefix_caching", "async_mode", "cuda_graphs", "gemm_autotune"):
            value = getattr(self, name)
            strict = name in ("enable_prefix_caching", "gemm_autotune")
            if not (isinstance(value, bool) or (value is None and not strict)):
                allowed = "true or false" if strict else "true, false or null (auto)"
                raise TypeError(f"{name} must be {allowed}, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {self.seed!r}")
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        if self.swap_space_gib and self.tensor_parallel_size > 1:
            raise ValueError("swap_space_gib > 0 is not supported with tensor_parallel_size > 1 yet; use 0 (recompute)")
        if self.tp_all_reduce not in TP_ALL_REDUCE:
            raise ValueError(f"tp_all_reduce must be one of {TP_ALL_REDUCE}, got {self.tp_all_reduce!r}")
        if self.tp_all_reduce == "symm_mem" and self.tensor_parallel_size == 1:
            raise ValueError("tp_all_reduce='symm_mem' needs tensor_parallel_size > 1 (and CUDA devices); "
                             "with one rank there is nothing to all-reduce, use 'nccl'")

    @property
    def num_rows(self) -> int:
        """The most rows a step computes: one per running sequence plus extra one-token rows of environment
        replies (``turn_rows_max_tokens``). Above ``max_num_seqs``, a reply landing while ``max_num_seqs``
        sequences decode is computed in one step instead of dripping in a row per step; off by default: on the
        H200 (fixed W4, 982d2c7) bursts of rows cost more than the steps they save (0.75x turn-synchronous
        against 0.88x dripping)."""
        return self.max_num_rows if self.max_num_rows is not None else self.max_num_seqs

    @classmethod
    def from_options(cls, **options: object) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; allowed: {sorted(known)}")
        return cls(**options)  # type: ignore[arg-type]


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
