"""Stop strings of generate_until, checked as each token comes without decoding the whole
continuation every time.

The rule (the harness's, and ours before): after each new token, the continuation stops once
`any(s in decode(ids) for s in until)`. Decoding all of `ids` at every token costs
O(length) per token, O(length^2) per continuation. `StopStrings.found` decodes only a tail
of the ids that holds at least `longest stop string + the newest token's text + MARGIN`
characters, and confirms a hit in the tail with one decode of the whole continuation, so
it never stops where the rule would not.

Why the tail is enough. A stop string that is in decode(ids) but was not in decode(ids[:-1])
ends in what the newest token changed: its own text, and the few characters before it
that a completed multi-byte character can turn from U+FFFD into a letter. So it lies in the
last `len(s) + len(the newest token's text) + a few` characters. A tail decoded on its own
is the end of the whole decode except for its first characters: SentencePiece drops a
leading space, and a tail that starts inside a UTF-8 character begins with U+FFFD; MARGIN
characters more cover those. The tests hold this against the old rule, token by token, on
real text with the GPT-NeoX and Llama 2 tokenizers, UTF-8 bytes and characters, and on
random token ids (tests/test_eval_harness.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# Characters a tail decoded on its own may get wrong at its start (a dropped leading space,
# up to 3 U+FFFD for a character cut at the tail's first token), with room to spare.
MARGIN = 8


class StopStrings:
    """`found(ids)`: whether decode(ids) holds one of `until`, for ids that grow by one token
    between calls (the generation loop's; each sequence its own list)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], until: Sequence[str]):
        self.decode = decode
        self.until = list(until)
        self.longest = max((len(s) for s in self.until), default=0)

    def found(self, ids: Sequence[int]) -> bool:
        if not self.until:
            return False
        n = len(ids)
        need = self.longest + len(self.decode(ids[-1:])) + MARGIN
        k = min(n, need)  # tokens; most tokens hold one character or more
        tail = self.decode(ids[n - k :])
        while len(tail) < need and k < n:  # short tokens (bytes, control pieces): widen
            k = min(n, 2 * k)
            tail = self.decode(ids[n - k :])
        if not any(s in tail for s in self.until):
            return False
        return k == n or any(s in self.decode(ids) for s in self.until)
