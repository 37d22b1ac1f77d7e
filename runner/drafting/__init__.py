"""Speculative drafting: what proposes the tokens a round asks the target to verify, and how many.

- ``drafters``: the ``Drafter`` interface, the draft model and n-gram lookup
- ``depth``: the draft depth, chosen round by round (``DepthController``) or pinned (``FixedDepth``)
- ``mtp``: a checkpoint's own multi-token-prediction layers as the drafter
- ``head``: an EAGLE-style drafter head trained here for a target
- ``block``: a DFlash-style block drafter, a block of tokens in one forward pass
"""
