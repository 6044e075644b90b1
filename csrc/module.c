/* dcpx._C: module definition (multi-phase init, PEP 489), small entry
 * points, and the error helper shared by the other translation units. */
#include "dcpx.h"
#include "cuda_api.h"
#include "gate.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

void dcpx_set_oserror(int err, const char *what, const char *path)
{
    char msg[256];
    PyObject *exc;
    snprintf(msg, sizeof(msg), "dcpx: %s failed: %s", what, strerror(err));
    exc = PyObject_CallFunction(PyExc_OSError, "isO&", err, msg,
                                PyUnicode_DecodeFSDefault, path);
    if (exc != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
}

PyDoc_STRVAR(crc32_doc, "crc32($module, data, value=0, /)\n--\n\n"
             "CRC-32 of a buffer, as zlib.crc32 computes it.");

static PyObject *dcpx_crc32_py(PyObject *m, PyObject *args)
{
    Py_buffer b;
    unsigned int value = 0;
    uint32_t crc;
    (void)m;
    if (!PyArg_ParseTuple(args, "y*|I:crc32", &b, &value))
        return NULL;
    if (b.len > (1 << 16)) {
        Py_BEGIN_ALLOW_THREADS
        crc = dcpx_crc32(value, b.buf, (size_t)b.len);
        Py_END_ALLOW_THREADS
    }
    else {
        crc = dcpx_crc32(value, b.buf, (size_t)b.len);
    }
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLong(crc);
}

PyDoc_STRVAR(crc32_copy_doc, "crc32_copy($module, dst, src, value=0, /)\n--\n\n"
             "Copy src into the writable buffer dst (at least as long) and "
             "return the CRC-32 of the bytes stored, read once from src (the "
             "writer's fused copy + CRC).");

static PyObject *dcpx_crc32_copy_py(PyObject *m, PyObject *args)
{
    Py_buffer d, s;
    unsigned int value = 0;
    uint32_t crc;
    (void)m;
    if (!PyArg_ParseTuple(args, "w*y*|I:crc32_copy", &d, &s, &value))
        return NULL;
    if (d.len < s.len) {
        PyBuffer_Release(&d);
        PyBuffer_Release(&s);
        PyErr_SetString(PyExc_ValueError, "dcpx: crc32_copy: dst is shorter than src");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    crc = dcpx_crc32_copy(value, d.buf, s.buf, (size_t)s.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&d);
    PyBuffer_Release(&s);
    return PyLong_FromUnsignedLong(crc);
}

PyDoc_STRVAR(combine_doc, "crc32_combine($module, crc_a, crc_b, len_b, /)\n--\n\n"
             "CRC-32 of A+B from crc32(A), crc32(B) and len(B).");

static PyObject *dcpx_combine_py(PyObject *m, PyObject *args)
{
    unsigned int a, b;
    unsigned long long len;
    (void)m;
    if (!PyArg_ParseTuple(args, "IIK:crc32_combine", &a, &b, &len))
        return NULL;
    return PyLong_FromUnsignedLong(dcpx_crc32_combine(a, b, len));
}

PyDoc_STRVAR(probe_doc, "probe_tensor($module, tensor, /)\n--\n\n"
             "Take a tensor through DLPack and describe what dcpx sees.");

PyObject *dcpx_probe_tensor(PyObject *m, PyObject *obj)
{
    dcpx_view v;
    PyObject *shape = NULL, *out = NULL;
    (void)m;
    if (dcpx_view_from_object(obj, &v, 0) < 0)
        return NULL;
    shape = PyTuple_New(v.ndim);
    for (int i = 0; shape != NULL && i < v.ndim; i++)
        PyTuple_SET_ITEM(shape, i, PyLong_FromLongLong(v.shape[i]));
    if (shape != NULL)
        out = Py_BuildValue("{s:K,s:O,s:I,s:K,s:i,s:i,s:i,s:i}", "ptr",
                            (unsigned long long)(uintptr_t)v.data, "shape",
                            shape, "itemsize", v.itemsize, "nbytes", v.nbytes,
                            "contiguous", v.contiguous, "device_type",
                            v.device_type, "read_only", v.read_only,
                            "versioned", v.managed_v != NULL);
    Py_XDECREF(shape);
    dcpx_view_release(&v);
    return out;
}

PyDoc_STRVAR(gather_doc, "gather_bytes($module, tensor, /)\n--\n\n"
             "The tensor's bytes in row-major order, as dcpx writes them.");

static PyObject *dcpx_gather_py(PyObject *m, PyObject *obj)
{
    dcpx_view v;
    PyObject *out;
    (void)m;
    if (dcpx_view_from_object(obj, &v, 0) < 0)
        return NULL;
    if (v.device_type != DCPX_DL_CPU) {
        dcpx_view_release(&v);
        PyErr_SetString(PyExc_ValueError, "dcpx: CPU tensor expected");
        return NULL;
    }
    out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)v.nbytes);
    if (out != NULL && v.nbytes)
        dcpx_view_gather(&v, 0, v.nbytes, PyBytes_AS_STRING(out));
    dcpx_view_release(&v);
    return out;
}

PyDoc_STRVAR(parse_doc, "parse_archive($module, data, /)\n--\n\n"
             "Parse a one-tensor torch.save archive held in memory: returns "
             "a dict (storage_type, numel, shape, stride, data_offset, "
             "data_length, crc, crc_ok) or raises ValueError.  For tests, the "
             "fuzzer and the tier's check of a replica as it arrives; the "
             "reader uses the same functions.");

static PyObject *dcpx_parse_py(PyObject *m, PyObject *args)
{
    Py_buffer b;
    const char *why = "";
    uint64_t cd_off, cd_len, pl, plen, dl, dlen, doff, poff;
    uint32_t pcrc, dcrc;
    dcpx_tensor_record rec;
    const unsigned char *p;
    PyObject *out = NULL, *shape = NULL, *stride = NULL;
    int rc;
    (void)m;
    if (!PyArg_ParseTuple(args, "y*:parse_archive", &b))
        return NULL;
    p = b.buf;
    uint64_t L = (uint64_t)b.len;
    memset(&rec, 0, sizeof(rec));
    rc = dcpx_zip_find_cd(p, (size_t)L, L, &cd_off, &cd_len, &why);
    if (rc == DCPX_PARSE_OK)
        rc = dcpx_zip_scan_cd(p + cd_off, cd_len, L, &pl, &plen, &pcrc, &dl,
                              &dlen, &dcrc, &why);
    if (rc == DCPX_PARSE_OK)
        rc = dcpx_zip_local_data_off(p + pl, L - pl, &poff, &why);
    if (rc == DCPX_PARSE_OK && (pl + poff > L || plen > L - pl - poff)) {
        rc = DCPX_PARSE_CORRUPT;
        why = "data.pkl outside the archive";
    }
    if (rc == DCPX_PARSE_OK)
        rc = dcpx_pickle_parse_tensor(p + pl + poff, plen, &rec, &why);
    if (rc == DCPX_PARSE_OK)
        rc = dcpx_zip_local_data_off(p + dl, L - dl, &doff, &why);
    if (rc == DCPX_PARSE_OK && (dl + doff > L || dlen > L - dl - doff)) {
        rc = DCPX_PARSE_CORRUPT;
        why = "data outside the archive";
    }
    if (rc != DCPX_PARSE_OK) {
        PyErr_Format(PyExc_ValueError, "dcpx: %s archive: %s",
                     rc == DCPX_PARSE_UNSUPPORTED ? "unsupported" : "corrupt",
                     why);
        goto done;
    }
    shape = PyTuple_New(rec.ndim);
    stride = PyTuple_New(rec.ndim);
    for (int i = 0; shape && stride && i < rec.ndim; i++) {
        PyTuple_SET_ITEM(shape, i, PyLong_FromLongLong(rec.shape[i]));
        PyTuple_SET_ITEM(stride, i, PyLong_FromLongLong(rec.stride[i]));
    }
    if (shape && stride) {
        uint32_t crc;
        if (dlen > (1 << 16)) {  /* the tier checks replicas on its own thread */
            Py_BEGIN_ALLOW_THREADS
            crc = dcpx_crc32(0, p + dl + doff, (size_t)dlen);
            Py_END_ALLOW_THREADS
        }
        else {
            crc = dcpx_crc32(0, p + dl + doff, (size_t)dlen);
        }
        out = Py_BuildValue("{s:s,s:K,s:i,s:K,s:O,s:O,s:K,s:K,s:k,s:O}",
                            "storage_type", rec.storage_type, "numel",
                            rec.storage_numel, "numel_in_bytes",
                            rec.numel_in_bytes, "storage_offset",
                            rec.storage_offset, "shape", shape, "stride",
                            stride, "data_offset", dl + doff, "data_length",
                            dlen, "crc", (unsigned long)dcrc, "crc_ok",
                            crc == dcrc ? Py_True : Py_False);
    }
done:
    Py_XDECREF(shape);
    Py_XDECREF(stride);
    PyBuffer_Release(&b);
    return out;
}

PyDoc_STRVAR(read_doc,
             "read_items($module, paths, items, threads=1, verify=True)\n--\n\n"
             "Read tensor archives into destination tensors without the GIL.\n"
             "items: [(file_index, offset, length, dest, storage_type)].\n"
             "Returns [(item_index, code, errno, message)] for items not "
             "read (1 fallback, 2 corrupt, 3 I/O, 4 CRC mismatch).");

PyDoc_STRVAR(read_plan_doc,
             "read_plan($module, paths, items, values, exporter, types, /)\n--\n\n"
             "A reusable read_items job: items [(file_index, offset, length, "
             "storage_type, position)] into values[position], checked as "
             "read_plan_run checks them; their dtype and shape are what later "
             "runs require.  A capsule for read_plan_run, or None if a "
             "destination cannot be read into in place.");

PyDoc_STRVAR(read_plan_run_doc,
             "read_plan_run($module, plan, values, exporter, types, threads=1, "
             "verify=True)\n--\n\n"
             "Run a read plan into values[position] of each item.  None, with "
             "nothing read, if a destination is not of `types`, has a neg / "
             "conj bit, or does not export (exporter) as the plan's dtype, "
             "shape and contiguous host memory; else failures as read_items.");

PyDoc_STRVAR(copy_doc,
             "copy_into($module, pairs, threads=1, base=None)\n--\n\n"
             "Copy each (src, dst) tensor pair, src strided or not, into its "
             "contiguous host destination, on C threads without the GIL.\n"
             "With base (a contiguous host tensor), dst is a byte offset into it.");

PyDoc_STRVAR(prefault_doc,
             "prefault($module, tensor, threads=1)\n--\n\n"
             "Fault in every page of a contiguous CPU tensor's memory (a new "
             "staging buffer) without the GIL.");

PyDoc_STRVAR(stage_plain_doc,
             "stage_plain($module, values, entries, base, threads=1)\n--\n\n"
             "The stager's copy for a state dict of the layout it staged last: "
             "check each entry (index, type, dtype, shape, requires_grad, offset, "
             "nbytes, is_complex) against values[index], a plain contiguous CPU tensor, and "
             "copy them all into base on C threads without the GIL.  False, "
             "nothing copied, when one differs.");

PyDoc_STRVAR(md_index_doc,
             "md_index($module, data, body_len, globals, dtypes, /)\n--\n\n"
             "Decode the .metadata pickle data[:body_len] into a load's tables "
             "without making Python objects of its contents: (index, files), or "
             "None for anything it does not fully understand (then the general "
             "path decodes and checks it).  See csrc/mdindex.c.");
PyDoc_STRVAR(md_index_check_doc,
             "md_index_check($module, index, sizes, /)\n--\n\n"
             "Whether every storage entry's extent lies within its file "
             "(sizes[f]: bytes of files[f], or None: files[f] not checked).");
PyDoc_STRVAR(md_index_bytes_doc,
             "md_index_bytes($module, index, cls, /)\n--\n\n"
             "{fqn: cls(relative_path, offset, length)} for every storage entry "
             "without an offset (the last one per fqn).");
PyDoc_STRVAR(md_index_region_doc,
             "md_index_region($module, index, fqn, region, chunk_cls, size_cls, info_cls, /)\n"
             "--\n\n"
             "Key fqn for one rank's plan: None (no such key), () (a non-tensor "
             "value), or (dtype, size, chunks, infos): the saved chunks that meet "
             "region = (offsets, sizes) (None: no chunks), and their storage "
             "entries (None where a chunk has none).");
PyDoc_STRVAR(md_index_len_doc,
             "md_index_len($module, index, /)\n--\n\n"
             "The number of keys in the metadata (its state_dict_metadata entries).");
PyDoc_STRVAR(md_index_entries_doc,
             "md_index_entries($module, index, /)\n--\n\n"
             "For tests: ({fqn: ('bytes',) or ('tensor', dtype, size, whole)}, "
             "[(fqn, offset or None, relative_path, offset, length), ...]); "
             "whole: the storage entry of its one whole chunk, or -1.");
PyDoc_STRVAR(read_plan_md_doc,
             "read_plan_md($module, index, paths, keys, values, exporter, types, "
             "allow_partial, threads=0, verify=True, check=None)\n--\n\n"
             "A read plan (as read_plan) for values[i] under keys[i] from an "
             "md_index: (plan, byte_keys, failures), None when the metadata does "
             "not fit a plan, False when a destination cannot be read into in "
             "place.  threads > 0 also runs it at once (failures as "
             "read_plan_run; else None).  check(files): called with the "
             "indices of the files the plan reads before any is opened; "
             "false makes the answer None.");
PyDoc_STRVAR(check_pickle_doc,
             "check_pickle($module, data, /)\n--\n\n"
             "Raise ValueError unless data is a pickle whose opcodes are safe "
             "to hand to the unpickler (bounded memo indices, lengths inside "
             "the data, no persistent ids, extensions or out-of-band buffers).");

PyDoc_STRVAR(dump_metadata_doc,
             "dump_metadata($module, metadata, kinds, protocol, names=None, "
             "tail=None, middle=None)\n--\n\n"
             "The pickle of a DCP Metadata object graph, written in C "
             "(csrc/mdpickle.c); it loads to objects equal to pickle.dumps's. "
             "kinds: {type: (kind, reducer)} for the non-builtin types "
             "(dcpx/formats/metadata.py builds it).  None when the graph holds "
             "anything else: the caller then uses Python's pickler.  With "
             "names (a tuple of str), the split form (csrc/mdpickle.c): "
             "(bytes, start, end): where the metadata's part (or the given "
             "middle) starts and ends.  With middle=b'', start == end is where "
             "a middle goes: the parts around it are encoded alone.");

PyDoc_STRVAR(scan_plain_doc,
             "scan_plain($module, values, expect, direct, dl_dtypes, export, cuda, /)\n--\n\n"
             "(payloads, holes, same): the C writer's payload of each plain CPU "
             "tensor of values as dcpx.storage.pending._direct_payload makes it, None "
             "at the indices in holes (left to Python), and whether every one "
             "matches the plan signature expect (csrc/payloads.c).");

PyDoc_STRVAR(dlpack_dtype_key_doc,
             "dlpack_dtype_key($module, capsule, /)\n--\n\n"
             "The key of an unused DLPack capsule's dtype in scan_plain's "
             "dl_dtypes, or -1 (csrc/payloads.c).");

PyDoc_STRVAR(cuda_version_doc,
             "cuda_driver_version($module, /)\n--\n\n"
             "Load the CUDA driver (libcuda.so.1, or $DCPX_LIBCUDA) and return "
             "(driver_version, device_count); raise CudaError if it cannot be "
             "loaded or is too old.");

PyDoc_STRVAR(cuda_register_doc,
             "cuda_host_register($module, buffer, /)\n--\n\n"
             "Page-lock a contiguous host buffer with cuMemHostRegister. "
             "True when pinned; False, with a RuntimeWarning, when the driver "
             "refuses (the buffer stays pageable).");

PyDoc_STRVAR(cuda_unregister_doc,
             "cuda_host_unregister($module, buffer, /)\n--\n\n"
             "Undo cuda_host_register.  False (a no-op) for a buffer this "
             "process did not register.");

PyDoc_STRVAR(cuda_release_doc,
             "cuda_release_all($module, /)\n--\n\n"
             "Unregister every buffer still registered, destroy dcpx's "
             "streams, release the primary contexts (interpreter exit).");

PyDoc_STRVAR(cuda_registered_doc,
             "cuda_registered($module, /)\n--\n\n"
             "(count, bytes) of the host ranges page-locked by dcpx and not "
             "yet unregistered; makes no driver call.");

PyDoc_STRVAR(cuda_copy_doc,
             "cuda_copy_into($module, pairs, base, wait_streams=(), "
             "wait=True, segment_bytes=64 MiB)\n--\n\n"
             "Copy CUDA tensors into a host staging buffer on dcpx's own "
             "stream, after the producer's pending work, and wait for the "
             "copies without the GIL.  pairs: [(src, byte_offset[, name])]; "
             "wait_streams: [(device, stream_handle)] to order after.  With "
             "wait=False, return (gate, pending) once the copies are queued "
             "in segments of segment_bytes: cuda_stage_wait(pending) waits, "
             "and writer items gated on `gate` wait for their segment "
             "(csrc/cuda_stage.c).");

PyDoc_STRVAR(cuda_load_doc,
             "cuda_copy_from_host($module, pairs, consumer_streams=(), "
             "wait=True)\n--\n\n"
             "Copy host buffers into CUDA tensors on dcpx's own stream, "
             "after the consumer streams' pending work and before their "
             "later work (events), and wait for the copies without the GIL. "
             " pairs: [(dst, src, name)]; consumer_streams: [(device, "
             "stream_handle)].  With wait=False, return once the copies are "
             "queued: a handle for cuda_wait (csrc/cuda_load.c).");

PyDoc_STRVAR(cuda_wait_doc,
             "cuda_wait($module, pending, /)\n--\n\n"
             "Wait, without the GIL, for the copies of "
             "cuda_copy_from_host(..., wait=False); raise CudaError naming "
             "the call, key and device if one failed.  Idempotent.");

PyDoc_STRVAR(cuda_stage_wait_doc,
             "cuda_stage_wait($module, pending, /)\n--\n\n"
             "Wait, without the GIL, for the segments of cuda_copy_into(..., "
             "wait=False), publishing each on its staging gate as it "
             "completes; raise CudaError (call, key, device) if a copy "
             "failed, after failing the gate.  Idempotent.");

PyDoc_STRVAR(cuda_pipeline_doc,
             "cuda_load_pipeline($module, paths, items, ring, "
             "consumer_streams=(), threads=4, verify=True, "
             "slot_bytes=4194304)\n--\n\n"
             "Read archives into CUDA tensors through a ring of page-locked "
             "slots, reads and host-to-device copies overlapped, the CRC "
             "computed on the bytes as they are read.  item: (file, offset, "
             "length, storage_type, shape, itemsize, dst, lo, key[, "
             "alloc_key]).  Returns (failures, stats); failures as "
             "read_items (csrc/cuda_pipeline.c).");

PyDoc_STRVAR(cuda_copy_stats_doc,
             "cuda_copy_stats($module, /)\n--\n\n"
             "The copy calls made since the CUDA driver was loaded (one per "
             "copy, batched calls and the copies they made, each direction) "
             "and the batched entry point in use, or None.");

PyDoc_STRVAR(cuda_batch_copies_doc,
             "cuda_batch_copies($module, enabled=None, /)\n--\n\n"
             "Switch batched copies (cuMemcpyBatchAsync, CUDA 12.8+) on or "
             "off for this process (None: as is); the entry point now in "
             "use, or None.");

PyDoc_STRVAR(gate_stats_doc,
             "gate_stats($module, gate, /)\n--\n\n"
             "(ready_bytes, failed, writers_blocked) of a staging gate (the "
             "writers waiting for bytes not yet published): for tests "
             "(csrc/gate.c).");

PyDoc_STRVAR(flatten_doc,
             "flatten_state_dict($module, state_dict, /)\n--\n\n"
             "(flat, mappings) exactly as torch's flatten_state_dict returns "
             "them, from one C walk; None where the walk cannot be sure to "
             "match torch (then call torch's; csrc/flatten.c says when).");

static PyMethodDef dcpx_methods[] = {
    {"flatten_state_dict", dcpx_flatten_state_dict, METH_O, flatten_doc},
    {"cuda_driver_version", dcpx_cuda_driver_version, METH_NOARGS,
     cuda_version_doc},
    {"cuda_host_register", dcpx_cuda_host_register, METH_VARARGS,
     cuda_register_doc},
    {"cuda_host_unregister", dcpx_cuda_host_unregister, METH_VARARGS,
     cuda_unregister_doc},
    {"cuda_release_all", dcpx_cuda_release_all, METH_NOARGS,
     cuda_release_doc},
    {"cuda_registered", dcpx_cuda_registered, METH_NOARGS,
     cuda_registered_doc},
    {"cuda_copy_into", (PyCFunction)(void (*)(void))dcpx_cuda_copy_into,
     METH_VARARGS | METH_KEYWORDS, cuda_copy_doc},
    {"cuda_copy_from_host",
     (PyCFunction)(void (*)(void))dcpx_cuda_copy_from_host,
     METH_VARARGS | METH_KEYWORDS, cuda_load_doc},
    {"cuda_wait", dcpx_cuda_wait, METH_O, cuda_wait_doc},
    {"cuda_load_pipeline",
     (PyCFunction)(void (*)(void))dcpx_cuda_load_pipeline,
     METH_VARARGS | METH_KEYWORDS, cuda_pipeline_doc},
    {"cuda_copy_stats", dcpx_cuda_copy_stats, METH_NOARGS,
     cuda_copy_stats_doc},
    {"cuda_batch_copies", dcpx_cuda_batch_copies, METH_VARARGS,
     cuda_batch_copies_doc},
    {"cuda_stage_wait", dcpx_cuda_stage_wait, METH_O, cuda_stage_wait_doc},
    {"gate_stats", dcpx_gate_stats, METH_O, gate_stats_doc},
    {"check_pickle", dcpx_check_pickle, METH_VARARGS, check_pickle_doc},
    {"md_index", dcpx_md_index, METH_VARARGS, md_index_doc},
    {"md_index_check", dcpx_md_index_check, METH_VARARGS, md_index_check_doc},
    {"md_index_bytes", dcpx_md_index_bytes, METH_VARARGS, md_index_bytes_doc},
    {"md_index_entries", dcpx_md_index_entries, METH_O, md_index_entries_doc},
    {"md_index_len", dcpx_md_index_len, METH_O, md_index_len_doc},
    {"md_index_region", dcpx_md_index_region, METH_VARARGS, md_index_region_doc},
    {"read_plan_md", (PyCFunction)(void (*)(void))dcpx_read_plan_md,
     METH_VARARGS | METH_KEYWORDS, read_plan_md_doc},
    {"dump_metadata", (PyCFunction)(void (*)(void))dcpx_dump_metadata,
     METH_VARARGS | METH_KEYWORDS, dump_metadata_doc},
    {"scan_plain", dcpx_scan_plain, METH_VARARGS, scan_plain_doc},
    {"dlpack_dtype_key", dcpx_dlpack_dtype_key, METH_O, dlpack_dtype_key_doc},
    {"prefault", (PyCFunction)(void (*)(void))dcpx_prefault,
     METH_VARARGS | METH_KEYWORDS, prefault_doc},
    {"stage_plain", (PyCFunction)(void (*)(void))dcpx_stage_plain,
     METH_VARARGS | METH_KEYWORDS, stage_plain_doc},
    {"copy_into", (PyCFunction)(void (*)(void))dcpx_copy_into,
     METH_VARARGS | METH_KEYWORDS, copy_doc},
    {"crc32", dcpx_crc32_py, METH_VARARGS, crc32_doc},
    {"crc32_copy", dcpx_crc32_copy_py, METH_VARARGS, crc32_copy_doc},
    {"crc32_combine", dcpx_combine_py, METH_VARARGS, combine_doc},
    {"probe_tensor", dcpx_probe_tensor, METH_O, probe_doc},
    {"gather_bytes", dcpx_gather_py, METH_O, gather_doc},
    {"parse_archive", dcpx_parse_py, METH_VARARGS, parse_doc},
    {"read_items", (PyCFunction)(void (*)(void))dcpx_read_items,
     METH_VARARGS | METH_KEYWORDS, read_doc},
    {"read_plan", dcpx_read_plan, METH_VARARGS, read_plan_doc},
    {"read_plan_run", (PyCFunction)(void (*)(void))dcpx_read_plan_run,
     METH_VARARGS | METH_KEYWORDS, read_plan_run_doc},
    {NULL, NULL, 0, NULL},
};

static int dcpx_exec(PyObject *m)
{
    dcpx_state *st = PyModule_GetState(m);
    dcpx_crc32_init();
    st->WriteJob_Type = (PyTypeObject *)PyType_FromModuleAndSpec(
        m, &dcpx_writejob_spec, NULL);
    if (st->WriteJob_Type == NULL)
        return -1;
    if (PyModule_AddType(m, st->WriteJob_Type) < 0)
        return -1;
    st->CudaError = PyErr_NewExceptionWithDoc(
        "dcpx._C.CudaError",
        "A CUDA driver call failed, or the driver cannot be used; `code` is "
        "the CUresult.", PyExc_RuntimeError, NULL);
    if (st->CudaError == NULL)
        return -1;
    /* PyModule_AddObjectRef is 3.10+: AddObject steals a reference on
     * success only. */
    Py_INCREF(st->CudaError);
    if (PyModule_AddObject(m, "CudaError", st->CudaError) < 0) {
        Py_DECREF(st->CudaError);
        return -1;
    }
    if (PyModule_AddStringConstant(m, "crc32_impl", dcpx_crc32_impl()) < 0)
        return -1;
    if (PyModule_AddIntConstant(m, "ALIGN", DCPX_ALIGN) < 0)
        return -1;
    return 0;
}

static int dcpx_traverse(PyObject *m, visitproc visit, void *arg)
{
    dcpx_state *st = PyModule_GetState(m);
    Py_VISIT(st->WriteJob_Type);
    Py_VISIT(st->CudaError);
    return dcpx_flatten_traverse(&st->flat, visit, arg);
}

static int dcpx_clear(PyObject *m)
{
    dcpx_state *st = PyModule_GetState(m);
    Py_CLEAR(st->WriteJob_Type);
    Py_CLEAR(st->CudaError);
    dcpx_flatten_clear(&st->flat);
    return 0;
}

static void dcpx_free(void *m) { dcpx_clear((PyObject *)m); }

static PyModuleDef_Slot dcpx_slots[] = {
    {Py_mod_exec, dcpx_exec},
    {0, NULL},
};

PyDoc_STRVAR(module_doc, "dcpx C core: DLPack ingestion, zip records, "
                         "CRC-32, and GIL-free writer and reader threads.");

static struct PyModuleDef dcpx_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "dcpx._C",
    .m_doc = module_doc,
    .m_size = sizeof(dcpx_state),
    .m_methods = dcpx_methods,
    .m_slots = dcpx_slots,
    .m_traverse = dcpx_traverse,
    .m_clear = dcpx_clear,
    .m_free = dcpx_free,
};

DCPX_EXPORT PyMODINIT_FUNC PyInit__C(void)
{
    return PyModuleDef_Init(&dcpx_module);
}
