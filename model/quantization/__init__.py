"""The stored weight formats the kernels compute from: 8-bit arrays with scales
(``quant_array``), GGUF blocks kept as stored (``gguf_blocks``), the integer mode's repacked
panels (``int8_panels``) and which matrices it multiplies in integers (``activations``)."""
