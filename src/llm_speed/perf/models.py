"""Transformer model configurations: a built-in zoo, Hugging Face ``config.json`` loading, parameter counts
and the GEMM shapes of one forward pass.

Every zoo entry copies the fields of the model's published ``config.json`` on the Hugging Face Hub (the URL is
in ``ModelConfig.source``). Nothing here touches the network: ``load_hf_config`` reads a local file.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from llm_speed.perf._checks import divisors_text

ATTENTION_TYPES = ("MHA", "MQA", "GQA", "MLA")


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only transformer, enough to count its parameters, FLOPs, bytes and KV cache.

    Attention: ``num_attention_heads`` query heads of ``head_dim``; ``num_kv_heads`` key/value heads (MHA when
    equal, MQA when 1, GQA otherwise). MLA (DeepSeek-V2/V3) is selected by ``kv_lora_rank > 0``: queries and
    keys have ``qk_nope_head_dim + qk_rope_head_dim`` per head, values ``v_head_dim``, and the cache holds the
    compressed latent (``kv_lora_rank``) plus the shared RoPE key (``qk_rope_head_dim``).

    MLP: ``intermediate_size`` wide, gated (SwiGLU: gate, up, down) when ``gated_mlp``. MoE when
    ``num_experts > 0``: the first ``first_dense_layers`` layers are dense, the rest route each token to
    ``experts_per_token`` of ``num_experts`` experts of width ``moe_intermediate_size``, plus
    ``num_shared_experts`` always-on experts of the same width.
    """

    name: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_embeddings: bool = False
    gated_mlp: bool = True
    activation: str = "silu"
    attention_bias: bool = False
    # Mixture of experts (0 experts: a dense model).
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    first_dense_layers: int = 0
    router_bias: bool = False  # a per-expert router score bias (DeepSeek-V3's e_score_correction_bias)
    # Multi-head latent attention (0: not MLA). q_lora_rank 0 with MLA means an uncompressed query projection.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    sliding_window: int | None = None
    source: str = ""
    aliases: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "num_layers",
            "num_attention_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig {self.name!r}: {name} must be a positive int, got {value!r}")
        for name in (
            "num_experts",
            "experts_per_token",
            "moe_intermediate_size",
            "num_shared_experts",
            "first_dense_layers",
            "kv_lora_rank",
            "q_lora_rank",
            "qk_rope_head_dim",
            "qk_nope_head_dim",
            "v_head_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ModelConfig {self.name!r}: {name} must be an int >= 0, got {value!r}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig {self.name!r}: num_kv_heads ({self.num_kv_heads}) must divide "
                f"num_attention_heads ({self.num_attention_heads}); valid num_kv_heads: "
                f"{divisors_text(self.num_attention_heads)}"
            )
        if self.num_experts:
            if not 0 < self.experts_per_token <= self.num_experts:
                raise ValueError(
                    f"ModelConfig {self.name!r}: experts_per_token must be in 1..num_experts "
                    f"({self.num_experts}), got {self.experts_per_token}"
                )
            if self.moe_intermediate_size <= 0:
                raise ValueError(f"ModelConfig {self.name!r}: an MoE model needs moe_intermediate_size > 0")
            if self.first_dense_layers >= self.num_layers:
                raise ValueError(f"ModelConfig {self.name!r}: first_dense_layers must be < num_layers")
        if self.kv_lora_rank and not (self.qk_rope_head_dim and self.qk_nope_head_dim and self.v_head_dim):
            raise ValueError(
                f"ModelConfig {self.name!r}: MLA (kv_lora_rank > 0) needs qk_rope_head_dim, qk_nope_head_dim "
                "and v_head_dim > 0"
            )
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
            raise ValueError(
                f"ModelConfig {self.name!r}: sliding_window must be None or an int > 0, got {window!r}"
            )

    # --- derived shape facts ---
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def uses_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def attention_type(self) -> str:
        """'MLA', 'MHA' (kv heads == heads), 'MQA' (1 kv head) or 'GQA'."""
        if self.uses_mla:
            return "MLA"
        if self.num_kv_heads == self.num_attention_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_dense_layers if self.is_moe else 0

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def qk_head_dim(self) -> int:
        """Per-head width of queries and keys (MLA: nope + rope part)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.uses_mla else self.head_dim

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim if self.uses_mla else self.head_dim

    @property
    def rope_dim(self) -> int:
        """Width of each query/key head that RoPE rotates (MLA rotates only the rope part)."""
        return self.qk_rope_head_dim if self.uses_mla else self.head_dim


def _hf(repo: str) -> str:
    return f"https://huggingface.co/{repo}/blob/main/config.json"


_LLAMA_3_8B = ModelConfig(
    name="llama-3-8b",
    hidden_size=4096,
    num_layers=32,
    num_attention_heads=32,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=14336,
    vocab_size=128256,
    max_position_embeddings=8192,
    source=_hf("meta-llama/Meta-Llama-3-8B"),
    aliases=("llama3-8b", "meta-llama-3-8b"),
)

_LLAMA_3_70B = ModelConfig(
    name="llama-3-70b",
    hidden_size=8192,
    num_layers=80,
    num_attention_heads=64,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=28672,
    vocab_size=128256,
    max_position_embeddings=8192,
    source=_hf("meta-llama/Meta-Llama-3-70B"),
    aliases=("llama3-70b", "meta-llama-3-70b"),
)


_ZOO: tuple[ModelConfig, ...] = (
    ModelConfig(
        name="llama-2-7b",
        hidden_size=4096,
        num_layers=32,
        num_attention_heads=32,
        num_kv_heads=32,
        head_dim=128,
        intermediate_size=11008,
        vocab_size=32000,
        max_position_embeddings=4096,
        source=_hf("meta-llama/Llama-2-7b-hf"),
        aliases=("llama2-7b",),
    ),
    ModelConfig(
        name="llama-2-13b",
        hidden_size=5120,
        num_layers=40,
        num_attention_heads=40,
        num_kv_heads=40,
        head_dim=128,
        intermediate_size=13824,
        vocab_size=32000,
        max_position_embeddings=4096,
        source=_hf("meta-llama/Llama-2-13b-hf"),
        aliases=("llama2-13b",),
    ),
    ModelConfig(
        name="llama-2-70b",
        hidden_size=8192,
        num_layers=80,
        num_attention_heads=64,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=28672,
        vocab_size=32000,
        max_position_embeddings=4096,
        source=_hf("meta-llama/Llama-2-70b-hf"),
        aliases=("llama2-70b",),
    ),
    _LLAMA_3_8B,
    _LLAMA_3_70B,
    # Llama 3.1: the Llama 3 shapes with a 128k context (RoPE scaling changes no cost counted here).
    replace(
        _LLAMA_3_8B,
        name="llama-3.1-8b",
        max_position_embeddings=131072,
        source=_hf("meta-llama/Llama-3.1-8B"),
        aliases=("llama3.1-8b", "meta-llama-3.1-8b"),
    ),
    replace(
        _LLAMA_3_70B,
        name="llama-3.1-70b",
        max_position_embeddings=131072,
        source=_hf("meta-llama/Llama-3.1-70B"),
        aliases=("llama3.1-70b", "meta-llama-3.1-70b"),
    ),
    ModelConfig(
        name="llama-3.1-405b",
        hidden_size=16384,
        num_layers=126,
        num_attention_heads=128,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=53248,
        vocab_size=128256,
        max_position_embeddings=131072,
        source=_hf("meta-llama/Llama-3.1-405B"),
        aliases=("llama3.1-405b", "llama-3-405b", "meta-llama-3.1-405b", "llama-405b"),
    ),
    ModelConfig(
        name="mistral-7b",
        hidden_size=4096,
        num_layers=32,
        num_attention_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=32000,
        max_position_embeddings=32768,
        sliding_window=4096,
        source=_hf("mistralai/Mistral-7B-v0.1"),
        aliases=("mistral-7b-v0.1", "mistral"),
    ),
    ModelConfig(
        name="mixtral-8x7b",
        hidden_size=4096,
        num_layers=32,
        num_attention_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=32000,
        max_position_embeddings=32768,
        num_experts=8,
        experts_per_token=2,
        moe_intermediate_size=14336,
        source=_hf("mistralai/Mixtral-8x7B-v0.1"),
        aliases=("mixtral", "mixtral-8x7b-v0.1"),
    ),
    ModelConfig(
        name="qwen2.5-7b",
        hidden_size=3584,
        num_layers=28,
        num_attention_heads=28,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=18944,
        vocab_size=152064,
        max_position_embeddings=131072,
        attention_bias=True,
        source=_hf("Qwen/Qwen2.5-7B"),
        aliases=("qwen-2.5-7b", "qwen25-7b"),
    ),
    ModelConfig(
        name="qwen2.5-72b",
        hidden_size=8192,
        num_layers=80,
        num_attention_heads=64,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=29568,
        vocab_size=152064,
        max_position_embeddings=131072,
        attention_bias=True,
        source=_hf("Qwen/Qwen2.5-72B"),
        aliases=("qwen-2.5-72b", "qwen25-72b"),
    ),
    # DeepSeek-V3: num_key_value_heads = 128 in its config; MLA caches the latent, not per-head K/V.
    # head_dim = qk_nope + qk_rope (192) is the query/key width; the multi-token-prediction module
    # (num_nextn_predict_layers = 1) is not part of the 671B main model and is left out.
    ModelConfig(
        name="deepseek-v3",
        hidden_size=7168,
        num_layers=61,
        num_attention_heads=128,
        num_kv_heads=128,
        head_dim=192,
        intermediate_size=18432,
        vocab_size=129280,
        max_position_embeddings=163840,
        num_experts=256,
        experts_per_token=8,
        moe_intermediate_size=2048,
        num_shared_experts=1,
        first_dense_layers=3,
        router_bias=True,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        source=_hf("deepseek-ai/DeepSeek-V3"),
        aliases=("deepseek-v3-base", "deepseekv3", "dsv3"),
    ),
)

_BY_ID: dict[str, ModelConfig] = {model.name: model for model in _ZOO}


def _normalize(name: str) -> str:
    """Lower case, last path segment, separators unified, common Hub suffixes dropped."""
    key = name.strip().lower().rsplit("/", 1)[-1]
    key = re.sub(r"[\s_]+", "-", key)
    key = re.sub(r"-(hf|base|instruct|chat)$", "", key)
    return key


_ALIASES: dict[str, str] = {}
for _model in _ZOO:
    for _alias in (_model.name, *_model.aliases):
        _ALIASES[_normalize(_alias)] = _model.name


def list_models() -> list[str]:
    """The ids of the built-in zoo, in a stable order."""
    return [model.name for model in _ZOO]


def get_model(name: str) -> ModelConfig:
    """The zoo entry for ``name``; case, ``_``/space separators, a Hub org prefix and ``-hf``/``-instruct``/
    ``-chat``/``-base`` suffixes are forgiven. Unknown names raise ValueError listing the valid ids."""
    if not isinstance(name, str):
        raise TypeError(f"model name must be a str, got {type(name).__name__}")
    key = _normalize(name)
    if key in _ALIASES:
        return _BY_ID[_ALIASES[key]]
    raise ValueError(
        f"unknown model {name!r}; valid ids: {', '.join(list_models())} (or a path to a config.json)"
    )


def resolve_model(model: ModelConfig | str) -> ModelConfig:
    """A ModelConfig as is; a str naming an existing file or directory is loaded with :func:`load_hf_config`,
    any other str is looked up with :func:`get_model`."""
    if isinstance(model, ModelConfig):
        return model
    if isinstance(model, str) and not model.strip():  # Path("") is the current folder
        ids = ", ".join(list_models())
        raise ValueError(f"model: an empty name; give a zoo id ({ids}) or a config.json path")
    if isinstance(model, (str, Path)) and Path(model).exists():
        return load_hf_config(model)
    if isinstance(model, Path) or (
        isinstance(model, str) and (model.endswith(".json") or model.startswith(("/", "./", "../", "~")))
    ):
        raise ValueError(
            f"model config {str(model)!r}: file not found (--model takes a zoo id or an existing config.json "
            "path or directory)"
        )
    if isinstance(model, str):
        return get_model(model)
    raise TypeError(
        f"model must be a ModelConfig, a zoo id or a config.json path, got {type(model).__name__}"
    )


# --- Hugging Face config.json ---

SUPPORTED_HF_MODEL_TYPES = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen3",
    "qwen2_moe",
    "qwen3_moe",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi3",
    "olmo2",
    "granite",
    "deepseek_v2",
    "deepseek_v3",
)
# transformers' configs that tie the LM head to the embeddings unless told otherwise.
_TIED_BY_DEFAULT = ("gemma", "gemma2", "gemma3_text")
_GATED_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh")


def load_hf_config(path: str | Path) -> ModelConfig:
    """Build a ModelConfig from a local Hugging Face ``config.json`` (or a directory holding one); no network.

    Understands the keys of the model types in ``SUPPORTED_HF_MODEL_TYPES``: ``num_key_value_heads`` (default:
    the head count), ``head_dim`` (default hidden/heads), Mixtral's ``num_local_experts``, Qwen2's always-on
    QKV bias and ``use_sliding_window`` (with ``max_window_layers``: all layers windowed or none), Qwen3
    (explicit ``head_dim``, no QKV bias), Phi-3 (``sliding_window`` on every layer, like Mistral), Gemma-2
    (``hidden_activation``, tied embeddings by default, as Gemma and Gemma-3), Qwen2-MoE and Qwen3-MoE
    (``num_experts``, ``moe_intermediate_size``; Qwen2-MoE's one shared expert of
    ``shared_expert_intermediate_size`` counts as that many experts of the routed width, which it is a
    multiple of in the released models), OLMo-2 and Granite (Llama's shapes: their q/k norms and scaling
    multipliers cost no modelled FLOPs), DeepSeek's ``n_routed_experts``, ``n_shared_experts``,
    ``first_k_dense_replace`` and MLA ranks. Required size keys must be positive integers, and the optional
    keys it reads must have their JSON type (integer, boolean or string) or be null, meaning absent;
    ValueError naming the file and the key otherwise, as for a file that is not UTF-8 JSON.

    Gemma-2 and Gemma-3 mix sliding-window and global layers; ModelConfig windows all layers or none, so
    their layers are all counted as global: KV cache and attention costs past the window are overestimated (at
    Gemma-2's 8,192-token context, the cache by 25%). Soft-capping and extra norms cost no modelled bytes.
    Qwen-MoE models whose ``decoder_sparse_step`` is not 1 or that list ``mlp_only_layers`` are refused
    (ModelConfig puts its dense layers first).
    """
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"config path {str(path)!r}: no such config.json file")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"config path {str(file)!r} is not valid JSON: {error}") from error
    except UnicodeDecodeError as error:
        # Its own message names neither the file nor what was expected of it.
        raise ValueError(f"config path {str(file)!r} is not UTF-8 JSON text: {error}") from error
    except OSError as error:
        raise ValueError(f"config path {str(file)!r} cannot be read: {error.strerror or error}") from error
    if not isinstance(raw, dict):
        raise ValueError(f"config path {str(file)!r}: expected a JSON object")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_HF_MODEL_TYPES:
        raise ValueError(
            f"config {str(file)!r}: model_type {model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_HF_MODEL_TYPES)}"
        )

    def need(key: str) -> int:
        if key not in raw:
            raise ValueError(f"config {str(file)!r} ({model_type}) lacks the key {key!r}")
        value = raw[key]
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"config {str(file)!r}: {key} must be a positive integer, got {value!r}")
        return value

    # Optional keys are checked as strictly as required ones: used unchecked, a wrong type surfaced as a
    # TypeError deep inside (or, for booleans, a string silently counted as true). JSON null means absent.
    def optional_int(key: str, default: int | None, minimum: int = 1) -> int | None:
        value = raw.get(key)
        if value is None:
            return default
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            expected = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise ValueError(f"config {str(file)!r}: {key} must be {expected} (or null), got {value!r}")
        return value

    def optional_bool(key: str, default: bool) -> bool:
        value = raw.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ValueError(f"config {str(file)!r}: {key} must be true or false (or null), got {value!r}")
        return value

    def optional_str(key: str) -> str | None:
        value = raw.get(key)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"config {str(file)!r}: {key} must be a string (or null), got {value!r}")
        return value or None

    hidden = need("hidden_size")
    heads = need("num_attention_heads")
    layers = need("num_hidden_layers")
    activation = optional_str("hidden_activation") or optional_str("hidden_act") or "silu"
    fields: dict = dict(
        name=str(raw.get("_name_or_path") or file.parent.name or file.stem),
        hidden_size=hidden,
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=optional_int("num_key_value_heads", heads),
        head_dim=optional_int("head_dim", hidden // heads),
        intermediate_size=need("intermediate_size"),
        vocab_size=need("vocab_size"),
        max_position_embeddings=need("max_position_embeddings"),
        tie_embeddings=optional_bool("tie_word_embeddings", model_type in _TIED_BY_DEFAULT),
        gated_mlp=activation in _GATED_ACTIVATIONS,
        activation=activation,
        attention_bias=optional_bool("attention_bias", False) or model_type == "qwen2",
        source=str(file),
    )
    # Read only by the model types that use it (Llama's and Gemma's are ignored); 0, like null, means none.
    uses_window = model_type in ("mistral", "phi3", "mixtral") or (
        model_type.startswith(("qwen2", "qwen3")) and optional_bool("use_sliding_window", False)
    )
    window = optional_int("sliding_window", None, minimum=0) or None if uses_window else None
    if model_type in ("mistral", "phi3"):
        fields["sliding_window"] = window
    windowed = model_type.startswith(("qwen2", "qwen3")) and window
    if windowed:
        # Qwen2 windows the layers from index max_window_layers on (transformers' Qwen2Config; default 28).
        full_layers = optional_int("max_window_layers", 28, minimum=0)
        if full_layers == 0:
            fields["sliding_window"] = window
        elif full_layers < layers:
            raise ValueError(
                f"config {str(file)!r}: {full_layers} full-attention layers then {layers - full_layers} "
                "sliding-window layers (max_window_layers) is not supported; ModelConfig windows all layers "
                "or none"
            )
    if model_type in ("qwen2_moe", "qwen3_moe"):
        if optional_int("decoder_sparse_step", 1) != 1 or raw.get("mlp_only_layers"):
            raise ValueError(
                f"config {str(file)!r}: decoder_sparse_step != 1 or mlp_only_layers is not supported; "
                "ModelConfig makes every layer past the first dense ones an MoE layer"
            )
        width = need("moe_intermediate_size")
        shared = 0
        if model_type == "qwen2_moe":
            shared = optional_int("shared_expert_intermediate_size", 0, minimum=0)
        if shared % width:
            raise ValueError(
                f"config {str(file)!r}: shared_expert_intermediate_size {shared} is not a multiple of "
                f"moe_intermediate_size {width}; ModelConfig's shared experts have the routed experts' width"
            )
        fields.update(
            num_experts=need("num_experts"),
            experts_per_token=need("num_experts_per_tok"),
            moe_intermediate_size=width,
            num_shared_experts=shared // width,
            attention_bias=model_type == "qwen2_moe" or bool(raw.get("attention_bias", False)),
        )
    if model_type == "mixtral":
        fields.update(
            num_experts=need("num_local_experts"),
            experts_per_token=need("num_experts_per_tok"),
            moe_intermediate_size=fields["intermediate_size"],
            sliding_window=window,
        )
    if model_type in ("deepseek_v2", "deepseek_v3"):
        if optional_int("moe_layer_freq", 1) != 1:
            raise ValueError(f"config {str(file)!r}: moe_layer_freq != 1 is not supported")
        fields.update(
            num_experts=optional_int("n_routed_experts", 0, minimum=0),
            experts_per_token=optional_int("num_experts_per_tok", 0, minimum=0),
            moe_intermediate_size=optional_int("moe_intermediate_size", 0, minimum=0),
            num_shared_experts=optional_int("n_shared_experts", 0, minimum=0),
            first_dense_layers=optional_int("first_k_dense_replace", 0, minimum=0),
            router_bias=optional_str("topk_method") == "noaux_tc",
            kv_lora_rank=need("kv_lora_rank"),
            q_lora_rank=optional_int("q_lora_rank", 0, minimum=0),
            qk_rope_head_dim=need("qk_rope_head_dim"),
            qk_nope_head_dim=need("qk_nope_head_dim"),
            v_head_dim=need("v_head_dim"),
            head_dim=need("qk_rope_head_dim") + need("qk_nope_head_dim"),
        )
    return ModelConfig(**fields)


# --- parameter counts ---


@dataclass(frozen=True)
class ParamCount:
    """Parameters by part. ``total`` counts every weight once (tied embeddings once); ``active`` is what one
    token uses (MoE: only ``experts_per_token`` routed experts per layer; embeddings counted)."""

    total: int
    active: int
    embedding: int
    lm_head: int
    attention: int
    dense_mlp: int
    routed_experts: int
    shared_experts: int
    router: int
    norms: int


def attention_params_per_layer(config: ModelConfig) -> int:
    """Weights of one attention block.

    Standard: W_q [h, H*d], W_k and W_v [h, Hkv*d], W_o [H*d, h] (+ q/k/v biases when ``attention_bias``).
    MLA (DeepSeek-V2 paper, section 2.1; DeepSeek-V3 ``modeling_deepseek.py``): q_a [h, r_q] + norm r_q +
    q_b [r_q, H*(d_nope+d_rope)] (or one [h, H*(d_nope+d_rope)] when r_q = 0), kv_a [h, r_kv + d_rope] + norm
    r_kv, kv_b [r_kv, H*(d_nope+d_v)], o [H*d_v, h].
    """
    h, heads = config.hidden_size, config.num_attention_heads
    if config.uses_mla:
        q_width = heads * config.qk_head_dim
        if config.q_lora_rank:
            q = h * config.q_lora_rank + config.q_lora_rank + config.q_lora_rank * q_width
        else:
            q = h * q_width
        kv = (
            h * (config.kv_lora_rank + config.qk_rope_head_dim)
            + config.kv_lora_rank
            + config.kv_lora_rank * heads * (config.qk_nope_head_dim + config.v_head_dim)
        )
        return q + kv + heads * config.v_head_dim * h
    q_width = heads * config.head_dim
    kv_width = config.num_kv_heads * config.head_dim
    bias = q_width + 2 * kv_width if config.attention_bias else 0
    return h * q_width + 2 * h * kv_width + q_width * h + bias


def mlp_params(hidden_size: int, intermediate_size: int, gated: bool) -> int:
    """One MLP: gated (SwiGLU) 3*h*I (gate, up, down), plain 2*h*I; no biases (true for the whole zoo)."""
    return (3 if gated else 2) * hidden_size * intermediate_size


def param_count(config: ModelConfig | str) -> ParamCount:
    """Count parameters from the shapes (see :func:`attention_params_per_layer` and :func:`mlp_params`).

    Per layer: attention + two RMSNorm weights (h each) + MLP; dense layers use ``intermediate_size``; MoE
    layers hold ``num_experts`` routed and ``num_shared_experts`` shared experts of ``moe_intermediate_size``
    plus a router [h, E] (+ E biases when ``router_bias``, as in DeepSeek-V3). Plus embeddings V*h, a final
    norm h and an LM head V*h unless tied. Matches the published totals, e.g. Llama-3-8B 8,030,261,248;
    Mixtral-8x7B 46.7B total / 12.9B active; DeepSeek-V3 671B / 37B. ``config`` may also be a zoo id or a
    config.json path.
    """
    config = resolve_model(config)
    h, layers = config.hidden_size, config.num_layers
    attention = attention_params_per_layer(config) * layers
    norms = 2 * h * layers + h  # the MLA latent norms are counted inside attention_params_per_layer
    dense_mlp = mlp_params(h, config.intermediate_size, config.gated_mlp) * config.num_dense_layers
    expert = mlp_params(h, config.moe_intermediate_size, config.gated_mlp) if config.is_moe else 0
    routed = expert * config.num_experts * config.num_moe_layers
    shared = expert * config.num_shared_experts * config.num_moe_layers
    router_bias = config.num_experts if config.router_bias else 0
    router = (h * config.num_experts + router_bias) * config.num_moe_layers
    embedding = config.vocab_size * h
    lm_head = 0 if config.tie_embeddings else config.vocab_size * h
    total = attention + norms + dense_mlp + routed + shared + router + embedding + lm_head
    inactive = expert * (config.num_experts - config.experts_per_token) * config.num_moe_layers
    return ParamCount(
        total=total,
        active=total - inactive,
        embedding=embedding,
        lm_head=lm_head,
        attention=attention,
        dense_mlp=dense_mlp,
        routed_experts=routed,
        shared_experts=shared,
        router=router,
        norms=norms,
    )


# --- GEMM shapes of one forward pass ---


@dataclass(frozen=True)
class GemmShape:
    """``count`` GEMMs out[m, n] = A[m, k] @ W[k, n] in one forward pass (count: layers[*experts])."""

    name: str
    m: int
    n: int
    k: int
    count: int

    @property
    def flops(self) -> int:
        """2*m*n*k per GEMM, times count."""
        return 2 * self.m * self.n * self.k * self.count


def routed_tokens_per_expert(config: ModelConfig, num_tokens: int) -> tuple[int, int]:
    """(experts that receive tokens, tokens each) under perfectly balanced routing: num_tokens * top_k
    assignments spread over min(E, num_tokens * top_k) experts, rounded up to whole tokens."""
    assignments = num_tokens * config.experts_per_token
    active = min(config.num_experts, assignments)
    return active, math.ceil(assignments / active)


def gemm_shapes(
    config: ModelConfig | str, num_tokens: int, *, lm_head_tokens: int | None = None
) -> list[GemmShape]:
    """The weight GEMMs of one forward pass over ``num_tokens`` tokens (batch * sequence).

    QKV fused (n = (H + 2*Hkv)*d), output projection, gate/up fused (n = 2I) or up, down, and the LM head over
    ``lm_head_tokens`` (default: every token; inference needs only the last token of each sequence). MLA: q_a,
    q_b (or q), kv_a, kv_b, o. MoE layers: the router GEMM, shared experts (m = num_tokens) and routed experts
    with balanced routing (:func:`routed_tokens_per_expert`). Attention score/value products are not weight
    GEMMs and are not listed. ``config`` may also be a zoo id or config.json path.
    """
    config = resolve_model(config)
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens <= 0:
        raise ValueError(f"num_tokens must be a positive int, got {num_tokens!r}")
    lm_tokens = num_tokens if lm_head_tokens is None else lm_head_tokens
    if not isinstance(lm_tokens, int) or lm_tokens <= 0:
        raise ValueError(f"lm_head_tokens must be a positive int, got {lm_head_tokens!r}")
    h, layers, t = config.hidden_size, config.num_layers, num_tokens
    heads = config.num_attention_heads
    shapes: list[GemmShape] = []
    if config.uses_mla:
        q_width = heads * config.qk_head_dim
        if config.q_lora_rank:
            shapes.append(GemmShape("q_a", t, config.q_lora_rank, h, layers))
            shapes.append(GemmShape("q_b", t, q_width, config.q_lora_rank, layers))
        else:
            shapes.append(GemmShape("q", t, q_width, h, layers))
        shapes.append(GemmShape("kv_a", t, config.kv_lora_rank + config.qk_rope_head_dim, h, layers))
        shapes.append(
            GemmShape(
                "kv_b", t, heads * (config.qk_nope_head_dim + config.v_head_dim), config.kv_lora_rank, layers
            )
        )
        shapes.append(GemmShape("o", t, h, heads * config.v_head_dim, layers))
    else:
        qkv_width = (heads + 2 * config.num_kv_heads) * config.head_dim
        shapes.append(GemmShape("qkv", t, qkv_width, h, layers))
        shapes.append(GemmShape("o", t, h, heads * config.head_dim, layers))
    up_factor = 2 if config.gated_mlp else 1
    up_name = "gate_up" if config.gated_mlp else "up"
    if config.num_dense_layers:
        shapes.append(GemmShape(up_name, t, up_factor * config.intermediate_size, h, config.num_dense_layers))
        shapes.append(GemmShape("down", t, h, config.intermediate_size, config.num_dense_layers))
    if config.is_moe:
        moe_layers, width = config.num_moe_layers, config.moe_intermediate_size
        shapes.append(GemmShape("router", t, config.num_experts, h, moe_layers))
        if config.num_shared_experts:
            shared_width = width * config.num_shared_experts
            shapes.append(GemmShape(f"shared_expert_{up_name}", t, up_factor * shared_width, h, moe_layers))
            shapes.append(GemmShape("shared_expert_down", t, h, shared_width, moe_layers))
        active, per_expert = routed_tokens_per_expert(config, t)
        shapes.append(GemmShape(f"expert_{up_name}", per_expert, up_factor * width, h, moe_layers * active))
        shapes.append(GemmShape("expert_down", per_expert, h, width, moe_layers * active))
    shapes.append(GemmShape("lm_head", lm_tokens, config.vocab_size, h, 1))
    return shapes
