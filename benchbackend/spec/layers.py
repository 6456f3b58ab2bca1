"""The layer vocabulary of a workload's ``model``: one validated record per layer type.

Each record declares its fields with their defaults, which are the conventions every backend
converts to (the NumPy reference defines them):

- ``conv2d``: ``padding`` is ``same`` (TensorFlow's: the odd pixel after, at any stride),
  ``valid``, an integer (every side) or ``[[top, bottom], [left, right]]``; ``use_bias``.
- ``maxpool2d``: ``padding`` in the same forms (default ``valid``); padding never wins a max.
- ``batchnorm``: Keras' ``momentum`` (``moving = momentum * moving + (1 - momentum) * batch``,
  default 0.99) and ``epsilon`` (default 1e-3); the moving variance takes the *biased* batch
  variance; batch statistics in training steps, moving statistics in inference.
- ``add``: two or more inputs of one shape, summed.
- ``global_avgpool``: (H, W, C) -> (C,), or over the tokens: (T, d) -> (d,).
- ``dense``: on a flat input (F,) -> (units,), or on the last axis of a token sequence (T, d) -> (T, units).
- ``activation``: ``gelu`` is the exact form ``x * Phi(x)`` (erf; torch's and ``keras.activations.gelu``'s
  default) unless ``approximate: true`` asks for the tanh form (``jax.nn.gelu``'s and ``keras.ops.gelu``'s
  default); an inline ``activation: gelu`` on any layer is the exact form.

The transformer layers work on token sequences (T, d), one sample's tokens as rows:

- ``tokens``: (H, W, C) -> (H*W, C), row-major over (h, w): a strided conv2d's patch grid as tokens;
- ``class_token``: (T, d) -> (T+1, d), a learned token prepended (token 0);
- ``position_embedding``: a learned (T, d) table added;
- ``layernorm``: over the last axis (biased variance), learned scale and offset; ``epsilon`` default
  1e-6, that of the published ViT (big_vision/flax, torchvision's and timm's ViT), which none of the
  frameworks' own defaults matches (torch 1e-5, Keras 1e-3): every adapter must pass it explicitly;
- ``attention``: multi-head self-attention, ``heads`` of ``head_dim``: query, key, value and output
  projections with biases, ``softmax(q k^T / sqrt(head_dim)) v`` per head (layout: ``model.py``);
- ``select_token``: (T, d) -> (d,), the token at ``index`` (default 0: the class token);
- ``dropout`` and ``add`` take token sequences as they are.

The decoder layers (language models; a sample is T token ids, the network's output T rows of
next-token probabilities):

- ``embedding``: (T,) token ids -> (T, width), a learned (vocab, width) table (``normal(0, 0.02)``);
- ``rmsnorm``: ``x / sqrt(mean(x^2) + epsilon) * s`` over the last axis, with ``s = w`` (Llama's,
  ``scale: w``, w starting at 1) or ``s = 1 + w`` (Gemma's, ``scale: one_plus_w``, w starting at 0);
  ``epsilon`` default 1e-6 (Hugging Face's ``LlamaRMSNorm``; Llama 3's checkpoints say 1e-5);
- ``attention`` with ``causal: true``: token t attends to tokens 0..t (itself included), never a
  later one; ``kv_heads``: grouped-query attention, the keys and values have ``kv_heads`` heads and
  query head h reads key/value head ``h // (heads // kv_heads)`` (blocks of consecutive query
  heads share one: Hugging Face's ``repeat_kv``; ``kv_heads: 1`` is multi-query); ``rope``: rotary
  positions on the queries and keys, ``{base: 10000, pairing: half}`` by default (see ``Rope``);
  ``use_bias: false`` drops the four projections' biases (Llama);
- ``multiply``: two or more inputs of one shape, multiplied elementwise (``silu(gate) * up``);
- ``dense`` with ``tied_to: NAME``: its kernel is the ``embedding`` NAME's table transposed,
  ``(width, vocab)``, one array shared by both (GPT-2's and Llama 3.2's output layer); ``use_bias:
  false`` drops its bias;
- the ``silu`` activation: ``x * sigmoid(x)``.

A ``repeat`` entry, ``{type: repeat, times: N, name: block, layers: [...]}``, is its ``layers``
written N times (``repeat.expand_repeats``): a name ``attn`` inside becomes ``block0.attn``,
``block1.attn``, ..., and inside the block ``input`` names the repetition's own input (the previous
repetition's output, or what precedes the block), so a residual is ``inputs: [input, attn]``.

Any layer may carry ``name`` (to be named in another layer's ``inputs``) and ``inputs`` (layer
names, or ``input`` for the network input; default: the previous layer's output). Fields added
after the first release (``name``, ``inputs``, ``use_bias``, a max-pool's ``padding``) are left
out of a layer's serialized form while at their defaults, so the workload hash of a network that
does not use them is what it always was.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

Activation = Literal["none", "relu", "softmax", "tanh", "sigmoid", "gelu", "silu"]
#: ``same``, ``valid``, one integer for every side, or ``((top, bottom), (left, right))``.
Padding = Union[Literal["same", "valid"], Annotated[int, Field(ge=0)],
                tuple[tuple[Annotated[int, Field(ge=0)], Annotated[int, Field(ge=0)]],
                      tuple[Annotated[int, Field(ge=0)], Annotated[int, Field(ge=0)]]]]
#: The name ``inputs`` uses for the network input.
INPUT_NAME = "input"


class Strict(BaseModel):
    """A frozen record that rejects unknown keys. Fields named in ``LATER`` were added after the
    workload hash was fixed: they are not serialized while at their default."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    LATER: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _without_later_defaults(self, handler: Any) -> Any:
        out = handler(self)
        fields = type(self).model_fields
        for name in self.LATER:
            if name in out and getattr(self, name) == fields[name].get_default(call_default_factory=True):
                del out[name]
        return out


class _Layer(Strict):
    LATER: ClassVar[tuple[str, ...]] = ("name", "inputs")
    name: Optional[str] = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_.-]*$",
                                description="a name other layers' `inputs` can refer to")
    inputs: Optional[list[str]] = Field(default=None, min_length=1,
                                        description="names of the layers (or `input`) this one reads")


class Conv2D(_Layer):
    LATER: ClassVar[tuple[str, ...]] = ("name", "inputs", "use_bias")
    type: Literal["conv2d"]
    filters: int = Field(gt=0)
    kernel_size: int = Field(gt=0)
    stride: int = Field(default=1, gt=0)
    padding: Padding = "same"
    activation: Activation = "none"
    use_bias: bool = True


class MaxPool2D(_Layer):
    LATER: ClassVar[tuple[str, ...]] = ("name", "inputs", "padding")
    type: Literal["maxpool2d"]
    pool_size: int = Field(default=2, gt=0)
    stride: Optional[int] = Field(default=None, gt=0)
    padding: Padding = "valid"


class Dropout(_Layer):
    type: Literal["dropout"]
    rate: float = Field(ge=0.0, lt=1.0)


class Flatten(_Layer):
    type: Literal["flatten"]


class Dense(_Layer):
    LATER: ClassVar[tuple[str, ...]] = ("name", "inputs", "use_bias", "tied_to")
    type: Literal["dense"]
    units: int = Field(gt=0)
    activation: Activation = "none"
    use_bias: bool = True
    tied_to: Optional[str] = Field(default=None, description="the name of an `embedding` layer whose table, "
                                   "transposed, is this layer's kernel (tied input and output embeddings)")


class ActivationLayer(_Layer):
    LATER: ClassVar[tuple[str, ...]] = ("name", "inputs", "approximate")
    type: Literal["activation"]
    function: Activation
    approximate: bool = Field(default=False, description="gelu only: `true` is the tanh form "
                              "0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3))); `false`, the exact x * Phi(x) (erf)")

    @model_validator(mode="after")
    def _approximate_is_gelu(self) -> "ActivationLayer":
        if self.approximate and self.function != "gelu":
            raise ValueError(f"`approximate` is for function gelu; the function is {self.function}")
        return self


class BatchNorm(_Layer):
    type: Literal["batchnorm"]
    momentum: float = Field(default=0.99, ge=0.0, lt=1.0,
                            description="Keras' meaning: weight of the old moving average")
    epsilon: float = Field(default=1e-3, gt=0.0)
    activation: Activation = "none"


class Add(_Layer):
    type: Literal["add"]
    activation: Activation = "none"


class GlobalAvgPool(_Layer):
    type: Literal["global_avgpool"]


class Tokens(_Layer):
    type: Literal["tokens"]


class ClassToken(_Layer):
    type: Literal["class_token"]


class PositionEmbedding(_Layer):
    type: Literal["position_embedding"]


class LayerNorm(_Layer):
    type: Literal["layernorm"]
    epsilon: float = Field(default=1e-6, gt=0.0, description="added to the variance (the published ViT's "
                           "1e-6; torch's default is 1e-5, Keras' 1e-3)")


class Rope(Strict):
    """Rotary position embedding of the queries and keys (RoFormer), per head: at position p, the
    pair (a, b) of dimensions numbered i = 0..head_dim/2 - 1 turns by the angle
    ``p * base ** (-2i / head_dim)``: ``(a cos - b sin, a sin + b cos)``. ``pairing: half`` pairs
    dimension i with i + head_dim/2 (``rotate_half``: GPT-NeoX, Hugging Face's Llama);
    ``interleaved`` pairs 2i with 2i + 1 (GPT-J, Meta's original Llama code). Same weights, other
    numbers: a checkpoint converted between the two permutes its q/k columns."""

    base: float = Field(default=10000.0, gt=1.0, description="10,000 (GPT-NeoX, Llama 2); 500,000 in Llama 3")
    pairing: Literal["half", "interleaved"] = Field(default="half", description="`half`: dimension i with "
                                                    "i + head_dim/2; `interleaved`: 2i with 2i + 1")


class Attention(_Layer):
    LATER: ClassVar[tuple[str, ...]] = ("name", "inputs", "causal", "kv_heads", "rope", "use_bias")
    type: Literal["attention"]
    heads: int = Field(gt=0, description="attention heads")
    head_dim: int = Field(gt=0, description="query/key/value width of one head; scores are scaled by "
                          "1/sqrt(head_dim)")
    causal: bool = Field(default=False, description="token t attends to tokens 0..t only")
    kv_heads: Optional[int] = Field(default=None, gt=0, description="key/value heads (grouped-query attention): "
                                    "query head h reads key/value head h // (heads // kv_heads); default: heads")
    rope: Optional[Rope] = Field(default=None, description="rotary positions on the queries and keys")
    use_bias: bool = Field(default=True, description="biases on the four projections")

    @model_validator(mode="after")
    def _groups(self) -> "Attention":
        if self.kv_heads is not None and self.heads % self.kv_heads:
            raise ValueError(f"`kv_heads` ({self.kv_heads}) must divide `heads` ({self.heads})")
        if self.rope is not None and self.head_dim % 2:
            raise ValueError(f"`rope` turns pairs of dimensions: `head_dim` must be even; got {self.head_dim}")
        return self

    @property
    def groups(self) -> int:
        """Key/value heads (``heads`` unless grouped)."""
        return self.kv_heads or self.heads


class SelectToken(_Layer):
    type: Literal["select_token"]
    index: int = Field(default=0, ge=0, description="which token: 0 is the one `class_token` prepends")


class Embedding(_Layer):
    type: Literal["embedding"]
    vocab: int = Field(gt=0, description="token ids 0..vocab-1")
    width: int = Field(gt=0, description="the vector each id maps to")


class RMSNorm(_Layer):
    type: Literal["rmsnorm"]
    epsilon: float = Field(default=1e-6, gt=0.0, description="added to the mean square (Hugging Face's "
                           "LlamaRMSNorm default; Llama 3's checkpoints use 1e-5)")
    scale: Literal["w", "one_plus_w"] = Field(default="w", description="`w`: x_hat * w, w starting at 1 (Llama); "
                                              "`one_plus_w`: x_hat * (1 + w), w starting at 0 (Gemma)")


class Multiply(_Layer):
    type: Literal["multiply"]


Layer = Annotated[Union[Conv2D, MaxPool2D, Dropout, Flatten, Dense, ActivationLayer, BatchNorm, Add, GlobalAvgPool,
                        Tokens, ClassToken, PositionEmbedding, LayerNorm, Attention, SelectToken, Embedding,
                        RMSNorm, Multiply],
                  Field(discriminator="type")]
LAYER_CLASSES: dict[str, type[_Layer]] = {
    "conv2d": Conv2D, "maxpool2d": MaxPool2D, "dropout": Dropout, "flatten": Flatten, "dense": Dense,
    "activation": ActivationLayer, "batchnorm": BatchNorm, "add": Add, "global_avgpool": GlobalAvgPool,
    "tokens": Tokens, "class_token": ClassToken, "position_embedding": PositionEmbedding, "layernorm": LayerNorm,
    "attention": Attention, "select_token": SelectToken, "embedding": Embedding, "rmsnorm": RMSNorm,
    "multiply": Multiply}
LAYER_TYPES = tuple(LAYER_CLASSES)
#: The layers of token sequences (``transformer.py`` resolves them; ``dense``, ``dropout``, ``add``,
#: ``multiply``, ``activation`` and ``global_avgpool`` take tokens too).
TOKEN_LAYERS = (Tokens, ClassToken, PositionEmbedding, LayerNorm, Attention, SelectToken, Embedding, RMSNorm)


def gelu_approximate(layer: Any) -> bool:
    """Whether ``layer``'s activation is GELU's tanh form (only an ``activation`` layer can ask for it)."""
    return isinstance(layer, ActivationLayer) and layer.function == "gelu" and layer.approximate


#: The activation name of GELU's tanh form for adapters that dispatch on a name (the reference, JAX):
#: the YAML says ``{function: gelu, approximate: true}``; ``gelu`` alone is the exact form.
GELU_TANH = "gelu_tanh"


def activation_name(layer: Any, fn: str) -> str:
    """The name of ``layer``'s activation ``fn`` where the tanh GELU needs its own: ``GELU_TANH``
    for GELU's tanh form, ``fn`` otherwise."""
    return GELU_TANH if gelu_approximate(layer) else fn


def activation_of(layer: Any) -> str:
    """The activation a layer applies to its output ("none" for layers without one)."""
    if isinstance(layer, ActivationLayer):
        return layer.function
    if isinstance(layer, (Conv2D, Dense, BatchNorm, Add)):
        return layer.activation
    return "none"
