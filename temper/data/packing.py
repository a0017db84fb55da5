"""Packed rows with isolated documents: positions restart per document, no cross-document label.

A document is its tokens plus the EOS that closes it, so in a packed row a document ends
after each EOS, and a row's first token starts one (a document cut by the row boundary
continues as a new one: attention never reaches into the previous row anyway). Inside a
document the last real token predicts its EOS; the EOS would predict the next document's
first token, so its label is ignored. Both are pure functions of the row's tokens, so the
dataset's saved position is unchanged by isolation. ``DocumentMask.from_position_ids``
(``temper.kernels.attention``) turns these positions into what attention needs.
"""

import torch
import torch.nn.functional as F

from temper.data.batch import IGNORE_INDEX


def document_position_ids(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Positions [..., s] that count from 0 at the row start and after every EOS."""
    starts = F.pad(input_ids[..., :-1] == eos_id, (1, 0), value=True)
    index = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
    start_of_document = torch.where(starts, index, 0).cummax(dim=-1).values
    return index - start_of_document


def document_labels(input_ids: torch.Tensor, labels: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Next-token ``labels`` without the ones that cross a boundary: an EOS predicts nothing."""
    return labels.masked_fill(input_ids == eos_id, IGNORE_INDEX)
