"""The one output step shared by the offline engine and the tokenizer service: a completion's new token
(or none) and the scheduler's finish reason become the text it gained and its final finish reason."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.services.tokenizer.text_stream import TextStream
from pagoda.shared.messages import FinishReason

RUNNING = -1  # the finish reason of a completion that goes on


@dataclass(slots=True)
class TextStep:
    text: str  # text safe to show now (held back while a character or a possible stop string is incomplete)
    finish_reason: int  # a FinishReason, or RUNNING
    stop_string: bool  # a stop string ended it here: the scheduler, which cannot see text, must be told


def advance(stream: TextStream, token_id: int, finish_reason: int) -> TextStep:
    """Push one step's token (-1: none) into `stream`; on a finish, release what it held back.

    A stop token's own text (EOS, stop_token_ids: finish STOP with a token) is not part of the output.
    A stop string that matches turns a running completion into STOP; one that completes only in the text
    held back until the end turns LENGTH into STOP too.
    """
    stop_token = finish_reason == FinishReason.STOP and token_id >= 0
    text = stream.push((token_id,) if token_id >= 0 and not stop_token else ())
    reason = finish_reason
    stop_string = False
    if reason < 0 and stream.stopped:
        reason = FinishReason.STOP
        stop_string = True
    if reason >= 0:
        text += stream.close()
        if stream.stopped:  # a stop string completed in the text held back until now
            reason = FinishReason.STOP
    return TextStep(text, int(reason), stop_string)
