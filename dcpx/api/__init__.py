"""torch.distributed.checkpoint's API on dcpx: ``save`` / ``load``
(``save_load``), ``async_save`` (``async_save``: the stager, the upload
thread, the futures), the PROCESS checkpointer's checkpoint process
(``process``; ``guard``: scripts without ``if __name__ == "__main__":``),
torch's older call forms (``bc``) and the rest of torch's namespace
(``compat``).

The public modules ``dcpx.staging``, ``dcpx.filesystem`` and ``dcpx.fsspec``
are this layer's too; ``dcpx/__init__.py`` (through ``dcpx._exports``)
gives its names.  Imports: the layers below (``dcpx.coordination``,
``dcpx.storage``, ``dcpx.formats``, the base) and one another
(tests/test_import_layers.py).  A new entry point of torch's API, or the
choice of a storage backend for a ``checkpoint_id``, goes here.
"""
