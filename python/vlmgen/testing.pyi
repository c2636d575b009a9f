from typing import Any, Optional

import torch

from . import Model

class ForwardCall:
    index: int
    step: int
    window_start: int
    window_end: int
    batch: int
    had_context: bool
    context_length: int
    pixel_values_shape: Optional[list[int]]
    image_grid_thw_shape: Optional[list[int]]
    image_sizes_shape: Optional[list[int]]
    image_embeddings_shape: Optional[list[int]]
    images: list[int]
    outcome: str
    error: str
    @property
    def input_ids(self) -> Optional[torch.Tensor]: ...
    @property
    def logits(self) -> Optional[torch.Tensor]: ...
    @property
    def window_size(self) -> int: ...
    def has_pixel_values(self) -> bool: ...
    def has_all_vision(self) -> bool: ...
    def has_any_vision(self) -> bool: ...

class ForwardSpy(Model):
    def __init__(self, model: Any, record_tensors: bool = False) -> None: ...
    @property
    def calls(self) -> list[ForwardCall]: ...
    def clear(self) -> None: ...

class DelegatingModel:
    inner: Model
    traits: Any
    def __init__(self, inner: Model) -> None: ...
    def forward(self, args: Any) -> torch.Tensor: ...
    def plan_positions(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, vision: Any) -> Any: ...
