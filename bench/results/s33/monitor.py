"""Every INTERVAL s: RSS/fds/threads per pagoda process + live-state gauges -> JSONL."""
import json, os, sys, time, urllib.request
INTERVAL = float(sys.argv[1]) if len(sys.argv) > 1 else 60
OUT = sys.argv[2] if len(sys.argv) > 2 else "/tmp/soak/monitor.jsonl"
pids = dict(line.split() for line in open("/tmp/soak/pids"))
GAUGES = ("pagoda_num_requests_running", "pagoda_num_requests_waiting", "pagoda_kv_cache_usage_ratio",
          "pagoda_kv_blocks_free", "pagoda_kv_blocks_total", "pagoda_num_tokenizers", "pagoda_num_preemptions_total",
          "pagoda_generation_tokens_total", "pagoda_prompt_tokens_total", "pagoda_e2e_request_latency_seconds_count")
def proc(pid):
    st = {}
    for line in open(f"/proc/{pid}/status"):
        k, _, v = line.partition(":")
        if k in ("VmRSS", "Threads", "VmHWM"):
            st[k] = int(v.split()[0])
    st["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return st
t0 = time.time()
while True:
    row = {"t": round(time.time() - t0, 1), "wall": time.strftime("%H:%M:%S")}
    for name, pid in pids.items():
        try:
            row[name] = proc(pid)
        except Exception as e:
            row[name] = {"error": repr(e)}
    try:
        text = urllib.request.urlopen("http://127.0.0.1:8410/metrics", timeout=10).read().decode()
        m = {}
        for line in text.splitlines():
            if line.startswith("#"):
                continue
            name, _, val = line.rpartition(" ")
            if name in GAUGES:
                m[name] = float(val)
        row["metrics"] = m
        st = json.loads(urllib.request.urlopen("http://127.0.0.1:8410/console/api/stats", timeout=10).read())
        e = st["engine"]
        row["console"] = {k: e[k] for k in ("running", "waiting", "preempted", "kv_blocks_used")}
        row["console"]["api_in_flight"] = st["api"]["requests_in_flight"]
        row["console"]["inspector_len"] = len(json.loads(urllib.request.urlopen(
            "http://127.0.0.1:8410/console/api/requests", timeout=10).read())["requests"])
    except Exception as e:
        row["metrics_error"] = repr(e)
    with open(OUT, "a") as f:
        f.write(json.dumps(row) + "\n")
    time.sleep(INTERVAL)
