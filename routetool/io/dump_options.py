"""The formats and reading options of the dump importers (:mod:`routetool.io.dumps`), without
importing them: the command line declares its options from these before torch is loaded."""

FORMATS = ("auto", "trace", "jsonl", "csv", "sglang", "counts-json", "vllm", "sglang-routed", "megatron",
           "megatron-ep-load", "flashinfer-trace")
DEFAULT_DROP_REPEATS = 64
"""Runs of at least this many identical consecutive rows are dropped as warm-up/dummy rows."""
READING_OPTIONS = {"num_experts": "--num-experts", "topk": "--topk", "skip_rows": "--skip-rows",
                   "drop_repeats": "--drop-repeats", "select": "--select"}
"""The options for reading dumps (:class:`ImportOptions` attribute -> command-line option)."""
TOKEN_ROW_OPTIONS = ("num_experts", "topk", "skip_rows", "drop_repeats")
COUNTS_OPTIONS = ("num_experts", "topk")
ENGINE_OPTIONS = ("num_experts", "topk")
OPTIONS_READ = {"jsonl": TOKEN_ROW_OPTIONS, "csv": TOKEN_ROW_OPTIONS, "sglang": TOKEN_ROW_OPTIONS,
                "counts-json": COUNTS_OPTIONS + ("select",), "vllm": ENGINE_OPTIONS, "sglang-routed": ENGINE_OPTIONS,
                "megatron": ENGINE_OPTIONS, "megatron-ep-load": ENGINE_OPTIONS, "flashinfer-trace": ENGINE_OPTIONS}
"""The reading options each dump format uses (SGLang: per-token dumps; its stat and per-pass
dumps of counts read ``num_experts`` and ``topk`` only; the engines' own outputs (vLLM,
SGLang routed experts, Megatron, FlashInfer-Trace) record real requests, not warm-up rows, and
read ``num_experts`` and ``topk`` only)."""
LOGITS_FORMATS = ("flashinfer-trace",)
"""Dump formats that hold router logits: they become traces a kernel can route."""
