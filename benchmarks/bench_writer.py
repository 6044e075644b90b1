"""The writer's own cost, without the disk: dcpx.save of one 1 GiB tensor
and of 20,000 small tensors (~137 MiB) into tmpfs (/dev/shm) with
sync_files=False, against os.write of the same bytes in the same process
(the limit: one pass over the bytes into the page cache).  Best of N wall
and CPU seconds; the ratio write/save is what to compare between trees.

    PYTHONPATH=$PWD python3 benchmarks/bench_writer.py [N]

Used to check that computing each record's CRC from the copy being written
(issue 10, item 2) costs no throughput: run it with PYTHONPATH at the tree
before and after, alternating (benchmarks/results/writer_local.md)."""
import os, sys, time, shutil, resource, tempfile
import torch, dcpx
n = int(sys.argv[1]) if len(sys.argv) > 1 else 5
root = tempfile.mkdtemp(dir="/dev/shm")
big = {"w": torch.randn(256 << 20)}            # 1 GiB fp32
small = {f"t{i}": torch.randn(1792) for i in range(20000)}  # ~137 MiB
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF); return r.ru_utime + r.ru_stime
def run(f):
    best_w = best_c = 1e9
    for _ in range(n):
        c0, t0 = cpu(), time.perf_counter(); f(); t1, c1 = time.perf_counter(), cpu()
        best_w, best_c = min(best_w, t1 - t0), min(best_c, c1 - c0)
    return best_w, best_c
def raw(sd):
    p = os.path.join(root, "raw")
    def f():
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        for t in sd.values():
            os.write(fd, memoryview(t.numpy()).cast("B"))
        os.close(fd); os.unlink(p)
    return f
def save(sd):
    def f():
        d = os.path.join(root, "ck"); shutil.rmtree(d, ignore_errors=True)
        dcpx.save(sd, storage_writer=dcpx.FileSystemWriter(d, sync_files=False))
    return f
for name, sd in (("1 GiB tensor", big), ("20,000 tensors", small)):
    rw, rc = run(raw(big) if sd is big else raw(sd))
    sw, sc = run(save(sd))
    print(f"{dcpx.__file__.split('/dcpx/')[0]} {name}: os.write {rw:.3f}s (cpu {rc:.3f}) "
          f"dcpx.save {sw:.3f}s (cpu {sc:.3f}) ratio write/save {rw/sw:.2f}")
shutil.rmtree(root)
