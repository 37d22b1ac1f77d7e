"""A checkpoint from its folder to the model the decoders call: what is done to it once, at load.

- ``load``: ``load_model`` (mlx-lm's model code, the dtype, the MTP layers kept or dropped) and ``LoadedModel``
- ``fusion``: projections that read one input (q/k/v, gate/up) stacked into one product, checked equal
- ``row_padding``: one-row products run as two rows where MKL is faster so, measured on the model
- ``attention``: small attentions run as plain ops where the backend's fused kernel is slower
- ``adapters``: LoRA adapters over one base, chosen per request
- ``architecture``: a checkpoint's architecture name, read from its config
"""
