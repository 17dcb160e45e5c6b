"""What a benchmark's files sit on, fio's random-read rate of them, and the V4.1 flash checkpoint
with its packed row file that the direct-read benchmarks share."""
import json
import os
import platform
import subprocess
import time


def sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"({e})"


def device(path):
    """What the files sit on: file system, block device, its queue."""
    src = sh(f"df --output=source {path} | tail -1")
    dev = os.path.basename(src)
    q = f"/sys/block/{dev}/queue"
    info = {"df": sh(f"df -T -h {path} | tail -1"), "lsblk": sh(f"lsblk -o NAME,SIZE,TYPE,ROTA,MODEL,SCHED {src}"),
            "cpu": sh("grep -m1 'model name' /proc/cpuinfo | cut -d: -f2").strip(), "cores": os.cpu_count(),
            "kernel": platform.release()}
    for k in ("logical_block_size", "max_sectors_kb", "nr_requests", "rotational", "scheduler"):
        info[k] = sh(f"cat {q}/{k} 2>/dev/null")
    info["virtio"] = os.path.exists(f"/sys/block/{dev}/device/driver") and "virtio" in os.path.realpath(
        f"/sys/block/{dev}/device/driver")
    return info


def ensure_checkpoint(d, evs, hidden):
    from engram_stream.v41 import hf
    if not os.path.isfile(os.path.join(d, "config.json")):
        cfg = hf.flash_config(engram_vocab_size=evs, dim=hidden)
        t0 = time.perf_counter()
        hf.make_synthetic(d, cfg, seed=0, n_shards=2, tokenizer=False, decoys=False)
        print(f"wrote {d} in {time.perf_counter() - t0:.0f} s", flush=True)
    from engram_stream import EngramModel
    from engram_stream.rows import packed
    rows = packed.rows_path(d)
    if not os.path.exists(rows):
        t0 = time.perf_counter()
        packed.pack_rows(EngramModel.from_deepseek_v41(d), rows)
        print(f"packed {rows} in {time.perf_counter() - t0:.0f} s", flush=True)
    return d


def fio(path, qd, seconds, size=None):
    """fio random 4 KiB reads, O_DIRECT, io_uring at iodepth qd: IOPS."""
    cmd = ["fio", "--name=r", f"--filename={path}", "--rw=randread", "--bs=4k", "--direct=1",
           "--ioengine=io_uring", f"--iodepth={qd}", f"--runtime={seconds}", "--time_based",
           "--output-format=json", "--randrepeat=0"]
    if size:
        cmd.append(f"--size={size}")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]["read"]
    return job["iops"]
