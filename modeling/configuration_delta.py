"""Configuration of delta-attention models (`model_type = "delta"`)."""

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters


#: the layer-type strings of `config.layer_types` (transformers' own, so its caches build the right layers)
DELTA_LAYER = "linear_attention"
FULL_ATTENTION_LAYER = "full_attention"
SLIDING_ATTENTION_LAYER = "sliding_attention"
DELTA_LAYER_TYPES = (DELTA_LAYER, FULL_ATTENTION_LAYER, SLIDING_ATTENTION_LAYER)
DELTA_GATES = ("none", "scalar", "channel")
CONV_ACTIVATIONS = (None, "silu")
OUTPUT_GATE_ACTIVATIONS = ("silu", "sigmoid")
#: `linear_state_sharing`: one delta state per (query) head, or one per KV head read by its group of query heads
STATE_SHARING = ("head", "kv_head")


def delta_layer_indices(layer_types) -> list[int]:
    """Indices of the delta layers in a list of layer types (the one definition of "which layers are delta")."""
    return [i for i, kind in enumerate(layer_types) if kind == DELTA_LAYER]


@strict
class DeltaConfig(PreTrainedConfig):
    r"""
    Configuration of a decoder whose layers mix delta attention (linear attention updated by the delta rule,
    one fixed-size state per head) with optional softmax attention.

    The Llama-family fields (`vocab_size`, `hidden_size`, `intermediate_size`, `num_hidden_layers`,
    `num_attention_heads`, `num_key_value_heads`, `head_dim`, `rope_parameters`, ...) mean what they mean in
    `LlamaConfig`. The delta fields all default to values derived from them.

    Args:
        layer_types (`list[str]`, *optional*):
            One entry per layer: `"linear_attention"` (delta), `"full_attention"` or `"sliding_attention"`.
            Defaults to every layer delta.
        sliding_window (`int`, *optional*):
            Window of the `"sliding_attention"` layers; required when there are any.
        attention_bias (`bool`, defaults to `False`):
            Bias on the q/k/v projections (Qwen2 style).
        attention_out_bias (`bool`, *optional*):
            Bias on `o_proj`; defaults to `attention_bias` (Llama style, where one flag covers all four).
        use_qk_norm (`bool`, defaults to `False`):
            RMSNorm over the head dimension of q and k (Qwen3 style), in softmax and delta layers alike.
        linear_gate (`str`, defaults to `"scalar"`):
            Decay of the delta layers: `"none"` (DeltaNet), `"scalar"` (Gated DeltaNet, one decay per head) or
            `"channel"` (KDA, one decay per key channel).
        linear_num_heads (`int`, *optional*):
            Delta heads (one state each); defaults to `num_attention_heads`.
        linear_key_head_dim / linear_value_head_dim (`int`, *optional*):
            Key and value dimension of a delta head; default to `head_dim`.
        linear_conv_kernel_size (`int`, defaults to 4):
            Short causal depthwise convolution on q, k, v; 0 switches it off.
        linear_conv_activation (`str`, *optional*, defaults to `"silu"`):
            Activation after the short convolution (`"silu"` as in fla, or `None`, better for converted models).
        linear_output_gate (`bool`, defaults to `True`):
            Multiply the normalised output by a gate computed from the layer input.
        linear_output_gate_activation (`str`, *optional*):
            `"silu"` or `"sigmoid"`; defaults to `"sigmoid"` for the channel gate (KDA) and `"silu"` otherwise.
        linear_allow_neg_eigval (`bool`, defaults to `False`):
            beta in (0, 2) instead of (0, 1).
        linear_gate_low_rank_dim (`int`, *optional*):
            Rank of the per-channel decay projection (channel gate only); defaults to `linear_key_head_dim`.
        linear_log_decay_floor (`float`, *optional*):
            Lower bound of the per-token log-decay (a negative number; `None`: unbounded). A token then keeps at
            least exp(floor) of the state. With the channel gate, -3.5 or above keeps every run of 16 tokens within
            the exact range of the fast chunk kernel (a decay of e^-60); steeper decays take the slow exact path.
            `convert --gate channel` sets -3.5.
        linear_chunk_size (`int`, defaults to 64):
            Chunk length of the chunkwise kernel.
        linear_state_sharing (`str`, defaults to `"head"`):
            `"head"`: one state per delta head (k, v, beta and decay per head). `"kv_head"`: one state per KV
            head (`num_key_value_heads` of them), read by its group of `linear_num_heads // num_key_value_heads`
            query heads, as GQA shares keys and values: k, v, beta and decay are per KV head, the state memory
            shrinks by the group size.
    """

    model_type = "delta"
    keys_to_ignore_at_inference = ["cache"]
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }

    vocab_size: int = 32000
    hidden_size: int = 1024
    intermediate_size: int = 2816
    num_hidden_layers: int = 12
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 8192
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = False
    rope_parameters: RopeParameters | dict | None = None
    attention_bias: bool = False
    attention_out_bias: bool | None = None
    attention_dropout: int | float = 0.0
    mlp_bias: bool = False
    use_qk_norm: bool = False
    layer_types: list[str] | None = None
    sliding_window: int | None = None

    linear_gate: str = "scalar"
    linear_num_heads: int | None = None
    linear_key_head_dim: int | None = None
    linear_value_head_dim: int | None = None
    linear_conv_kernel_size: int = 4
    linear_conv_activation: str | None = "silu"
    linear_output_gate: bool = True
    linear_output_gate_activation: str | None = None
    linear_allow_neg_eigval: bool = False
    linear_gate_low_rank_dim: int | None = None
    linear_log_decay_floor: float | None = None
    linear_chunk_size: int = 64
    linear_state_sharing: str = "head"

    def __post_init__(self, **kwargs):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.attention_out_bias is None:
            self.attention_out_bias = self.attention_bias
        if self.layer_types is None:
            self.layer_types = [DELTA_LAYER] * self.num_hidden_layers
        if self.linear_num_heads is None:
            self.linear_num_heads = self.num_attention_heads
        if self.linear_key_head_dim is None:
            self.linear_key_head_dim = self.head_dim
        if self.linear_value_head_dim is None:
            self.linear_value_head_dim = self.head_dim
        if self.linear_gate_low_rank_dim is None:
            self.linear_gate_low_rank_dim = self.linear_key_head_dim
        if self.linear_output_gate_activation is None:
            self.linear_output_gate_activation = "sigmoid" if self.linear_gate == "channel" else "silu"
        # Remote loading needs every Auto class in `auto_map`; `save_pretrained` only adds the class it saves.
        if kwargs.get("auto_map") is None:
            kwargs["auto_map"] = {
                "AutoConfig": "configuration_delta.DeltaConfig",
                "AutoModel": "modeling_delta.DeltaModel",
                "AutoModelForCausalLM": "modeling_delta.DeltaForCausalLM",
            }
        kwargs.setdefault("rope_theta", 10000.0)
        super().__post_init__(**kwargs)

    @property
    def delta_layers(self) -> list[int]:
        """Indices of the delta (linear attention) layers."""
        return delta_layer_indices(self.layer_types)

    @property
    def num_delta_layers(self) -> int:
        return len(self.delta_layers)

    @property
    def linear_num_state_heads(self) -> int:
        """Delta states per layer: `num_key_value_heads` with `linear_state_sharing="kv_head"`, else
        `linear_num_heads`."""
        return self.num_key_value_heads if self.linear_state_sharing == "kv_head" else self.linear_num_heads

    def validate_layer_type(self):
        """Every entry of `layer_types` is one of ours, and there is one per layer."""
        unknown = sorted({t for t in self.layer_types if t not in DELTA_LAYER_TYPES})
        if unknown:
            raise ValueError(
                f"`layer_types` contains unknown layer type(s) {unknown}; allowed values are {list(DELTA_LAYER_TYPES)}."
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"`layer_types` has {len(self.layer_types)} entries but `num_hidden_layers` is "
                f"{self.num_hidden_layers}: give exactly one layer type per layer."
            )
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("`sliding_window` must be a positive int when `layer_types` has 'sliding_attention' layers.")

    def validate_architecture(self):
        """Head counts divide, sizes are positive, and the delta options take allowed values."""
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"`num_attention_heads` ({self.num_attention_heads}) must be divisible by `num_key_value_heads` "
                f"({self.num_key_value_heads})."
            )
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "linear_num_heads",
                     "linear_key_head_dim", "linear_value_head_dim", "linear_chunk_size", "linear_gate_low_rank_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"`{name}` must be a positive int, got {getattr(self, name)}.")
        if self.linear_gate not in DELTA_GATES:
            raise ValueError(
                f"`linear_gate` must be one of {list(DELTA_GATES)} (none = DeltaNet, scalar = Gated DeltaNet, "
                f"channel = KDA), got {self.linear_gate!r}."
            )
        if self.linear_state_sharing not in STATE_SHARING:
            raise ValueError(
                f"`linear_state_sharing` must be one of {list(STATE_SHARING)} (head = one state per delta head, "
                f"kv_head = one state per KV head shared by its query heads), got {self.linear_state_sharing!r}."
            )
        if self.linear_state_sharing == "kv_head" and self.linear_num_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"`linear_state_sharing='kv_head'` needs `linear_num_heads` ({self.linear_num_heads}) divisible by "
                f"`num_key_value_heads` ({self.num_key_value_heads}); change one of them or use 'head'."
            )
        if self.linear_conv_kernel_size < 0:
            raise ValueError(f"`linear_conv_kernel_size` must be >= 0 (0 = off), got {self.linear_conv_kernel_size}.")
        if self.linear_conv_activation not in CONV_ACTIVATIONS:
            raise ValueError(
                f"`linear_conv_activation` must be one of {list(CONV_ACTIVATIONS)}, got {self.linear_conv_activation!r}."
            )
        if self.linear_log_decay_floor is not None and not self.linear_log_decay_floor < 0:
            raise ValueError(
                f"`linear_log_decay_floor` must be a negative number (or None for no floor), "
                f"got {self.linear_log_decay_floor!r}."
            )
        if self.linear_output_gate_activation not in OUTPUT_GATE_ACTIVATIONS:
            raise ValueError(
                f"`linear_output_gate_activation` must be one of {list(OUTPUT_GATE_ACTIVATIONS)}, "
                f"got {self.linear_output_gate_activation!r}."
            )


DeltaConfig.register_for_auto_class()

__all__ = ["DELTA_GATES", "DELTA_LAYER", "DELTA_LAYER_TYPES", "STATE_SHARING", "DeltaConfig",
           "delta_layer_indices"]
