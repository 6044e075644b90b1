"""The bytes on disk: torch DCP's format, read and written exactly.

The lowest layer of dcpx above its base (``dcpx.errors``, ``dcpx._C``,
``dcpx._torchcompat``): it knows how a checkpoint's files are laid out and
encoded, and nothing of ranks, plans or saves in flight.  A module per
format or concept:

* ``files``: the checkpoint's file names, local paths and URLs, and opening
  its files as regular files only;
* ``metadata``: the ``.metadata`` pickle (built, encoded with dcpx's
  integrity trailer, decoded without running code);
* ``values``: non-tensor values, unpickled under the allow-list;
* ``dtypes``: how each dtype is named in a ``torch.save`` archive and enters
  the C core (TORCH_SAVE records themselves are csrc/zipwrite.c and
  csrc/reader.c);
* ``safetensors``: DCP's SAFETENSORS data files; ``transforms``: torch's
  stream transforms (ZStandard); ``entries``: which of these each storage
  entry uses;
* ``byteorder``: archives from big-endian hosts; ``legacy``: torch 2.0-2.3's
  layout; ``chunks``: how saved chunks tile a tensor.

Imports: only ``dcpx.errors``, ``dcpx._C``, ``dcpx._torchcompat`` and each
other (tests/test_import_layers.py).  A new storage format goes here.
"""
