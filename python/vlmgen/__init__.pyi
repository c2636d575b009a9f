"""Type stubs of the vlmgen Python module (python/src/*.cpp)."""

from typing import Any, Callable, Iterator, Optional, Protocol, Sequence, Union

import torch

from . import testing as testing

__version__: str

class Error(RuntimeError):
    """Bad input or an impossible request; the message says what was expected and what came."""

class KvCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    def __init__(self, *, num_layers: int = ..., num_kv_heads: int = ..., head_dim: int = ...,
                 dtype: Union[str, torch.dtype] = ...) -> None: ...
    def bytes_per_token(self) -> int: ...

class ModelTraits:
    vocab_size: int
    image_token_id: Optional[int]
    vision_start_token_id: Optional[int]
    vision_end_token_id: Optional[int]
    video_token_id: Optional[int]
    spatial_merge_size: int
    tokens_per_image: int
    max_sequence_length: int
    supports_kv_cache: bool
    kv_cache_under_sequence_parallel: bool
    accepts_partial_image_span: bool
    vocab_parallel_logits: bool
    vision_layout: str
    kv_cache: KvCacheSpec
    def __init__(self, **fields: Any) -> None: ...

class RopePlan:
    prompt_positions: torch.Tensor
    delta: list[int]
    def __init__(self, prompt_positions: torch.Tensor, delta: Sequence[int]) -> None: ...

class VisionInputs:
    def __init__(self, pixel_values: Optional[torch.Tensor] = None, image_grid_thw: Optional[torch.Tensor] = None,
                 image_sizes: Optional[torch.Tensor] = None, layout: str = "patch_flattened") -> None: ...
    @property
    def pixel_values(self) -> Optional[torch.Tensor]: ...
    @property
    def image_grid_thw(self) -> Optional[torch.Tensor]: ...
    @property
    def image_sizes(self) -> Optional[torch.Tensor]: ...
    @property
    def layout(self) -> str: ...
    @property
    def num_images(self) -> int: ...
    @property
    def empty(self) -> bool: ...
    def select(self, images: Sequence[int]) -> VisionInputs: ...

class InferenceContext:
    """A KV cache and the tokens it holds; continue a conversation by passing it again."""
    def __init__(self, spec: KvCacheSpec, batch: int, capacity: int) -> None: ...
    @staticmethod
    def for_model(model: Any, batch: int, capacity: int) -> InferenceContext: ...
    @property
    def length(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def bytes(self) -> int: ...
    @property
    def tokens(self) -> torch.Tensor: ...
    @property
    def attention_mask(self) -> torch.Tensor: ...
    def append_kv(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def truncate(self, length: int) -> None: ...
    def clone(self) -> InferenceContext: ...

class ForwardArgs:
    """One forward call: valid (its context) during that call only."""
    @property
    def input_ids(self) -> torch.Tensor: ...
    @property
    def position_ids(self) -> torch.Tensor: ...
    @property
    def attention_mask(self) -> torch.Tensor: ...
    @property
    def window_start(self) -> int: ...
    @property
    def window_end(self) -> int: ...
    @property
    def step(self) -> int: ...
    @property
    def last_column_logits(self) -> bool: ...
    @property
    def pixel_values(self) -> Optional[torch.Tensor]: ...
    @property
    def image_grid_thw(self) -> Optional[torch.Tensor]: ...
    @property
    def image_sizes(self) -> Optional[torch.Tensor]: ...
    @property
    def image_embeddings(self) -> Optional[torch.Tensor]: ...
    @property
    def vision(self) -> VisionInputs: ...
    @property
    def images(self) -> list[int]: ...
    @property
    def context(self) -> Optional[InferenceContext]: ...

Prompts = Union[Sequence[Sequence[int]], Sequence[torch.Tensor], torch.Tensor]

class PythonModel(Protocol):
    """What Generator accepts besides a vlmgen.Model: `traits` (an attribute, or a method called
    once; without it, an HF-style `config` with vocab_size and the image token ids) and forward.
    Optional: plan_positions, encode_images, device."""
    traits: Union[ModelTraits, dict[str, Any], Callable[[], Union[ModelTraits, dict[str, Any]]]]
    def forward(self, args: ForwardArgs) -> torch.Tensor: ...

class Model:
    """A model implemented in C++ (load_model)."""
    @property
    def traits(self) -> ModelTraits: ...
    @property
    def device(self) -> str: ...
    @property
    def can_encode_images(self) -> bool: ...
    def forward(self, args: ForwardArgs) -> torch.Tensor: ...
    def plan_positions(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       vision: VisionInputs) -> RopePlan: ...
    def placeholder_counts(self, vision: VisionInputs) -> list[int]: ...
    def encode_images(self, vision: VisionInputs) -> torch.Tensor: ...

def load_model(dir: str, dtype: str = "f32", device: str = "cpu", huge_pages: bool = True) -> Model: ...

class GenerationConfig:
    max_new_tokens: int
    enable_kv_cache: bool
    replay_mode: str
    end_token_ids: list[int]
    stop_token_ids: list[int]
    pad_token_id: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    row_seeds: list[int]
    return_logprobs: bool
    prefill_chunk_size: int
    encoder_cache: bool
    allow_placeholder_tokens: bool
    full_logits: bool
    check_pixel_values: bool
    prompt_logprobs: bool
    top_logprobs: int
    return_logits: bool
    def __init__(self, **options: Any) -> None: ...

class TokenEvent:
    row: int
    step: int
    token: int
    logprob: float
    top_logprobs: list[tuple[int, float]]
    finish_reason: Optional[str]

class SequenceOutput:
    tokens: list[int]
    finish_reason: str
    logprobs: list[float]
    prompt_logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    logits: Optional[torch.Tensor]

class GenerationStats:
    used_kv_cache: bool
    forward_calls: int
    prompt_columns: int
    generated_tokens: int
    images_encoded: int
    time_to_first_token_s: float
    decode_tokens_per_s: float
    total_s: float

class GenerationResult:
    sequences: list[SequenceOutput]
    stats: GenerationStats
    @property
    def tokens(self) -> list[list[int]]: ...

class GenerateRequest:
    prompts: list[list[int]]
    vision: VisionInputs
    context: Optional[InferenceContext]
    on_token: Optional[Callable[[TokenEvent], Optional[bool]]]
    def __init__(self, prompts: Prompts, vision: Optional[VisionInputs] = None,
                 context: Optional[InferenceContext] = None,
                 on_token: Optional[Callable[[TokenEvent], Optional[bool]]] = None,
                 attention_mask: Optional[torch.Tensor] = None) -> None: ...

class TokenStream(Iterator[TokenEvent]):
    def __iter__(self) -> TokenStream: ...
    def __next__(self) -> TokenEvent: ...
    def close(self) -> None: ...
    def __enter__(self) -> TokenStream: ...
    def __exit__(self, *args: Any) -> None: ...
    @property
    def result(self) -> GenerationResult: ...

class Generator:
    def __init__(self, model: Union[Model, PythonModel]) -> None: ...
    @property
    def model(self) -> Any: ...
    def generate(self, prompts: Union[Prompts, GenerateRequest],
                 config: Optional[GenerationConfig] = None, *, vision: Optional[VisionInputs] = None,
                 context: Optional[InferenceContext] = None,
                 on_token: Optional[Callable[[TokenEvent], Optional[bool]]] = None,
                 attention_mask: Optional[torch.Tensor] = None) -> GenerationResult: ...
    def stream(self, prompts: Union[Prompts, GenerateRequest],
               config: Optional[GenerationConfig] = None, *, vision: Optional[VisionInputs] = None,
               context: Optional[InferenceContext] = None,
               attention_mask: Optional[torch.Tensor] = None) -> TokenStream: ...

def load_image(path: str) -> torch.Tensor: ...
def preprocess_images(images: Sequence[Union[str, torch.Tensor]], checkpoint: Optional[str] = None,
                      min_pixels: int = 0, max_pixels: int = 0) -> VisionInputs: ...
def save_safetensors(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] = ...) -> None: ...
def load_safetensors(path: str) -> dict[str, torch.Tensor]: ...

class Tokenizer:
    @staticmethod
    def from_pretrained(dir: str) -> Tokenizer: ...
    @staticmethod
    def from_file(path: str) -> Tokenizer: ...
    def encode(self, text: str, parse_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...
    def token_id(self, content: str) -> Optional[int]: ...
    def is_special(self, id: int) -> bool: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_token(self) -> Optional[str]: ...
    @property
    def pad_token(self) -> Optional[str]: ...
    @property
    def bos_token(self) -> Optional[str]: ...

class ChatPrompt:
    ids: list[int]
    vision: VisionInputs
    num_images: int

class ChatProcessor:
    @staticmethod
    def from_pretrained(dir: str, tokenizer: Optional[Tokenizer] = None) -> ChatProcessor: ...
    @property
    def tokenizer(self) -> Tokenizer: ...
    def build(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
              add_vision_id: bool = False) -> ChatPrompt: ...

def end_token_ids(dir: str, tokenizer: Tokenizer) -> list[int]: ...
