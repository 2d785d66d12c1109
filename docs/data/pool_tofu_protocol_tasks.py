"""docs/results.md, the TOFU-protocol benchmark: forget task 3 (its own bench folder, SCHEMES.json) pooled with
tasks 1 and 2, which docs/results.md gives as mean +- sample std of 2 values; two values a, b come back exactly from
their mean m and sample std s as {m - s/sqrt2, m + s/sqrt2}. Prints the pooled tables in Markdown."""
import json, math, statistics, sys
from doplus_cli.bench.tradeoff import at_level

OUT = sys.argv[1] if len(sys.argv) > 1 else "bench/tofu_protocol"  # the task-3 bench folder
S = json.load(open(f"{OUT}/SCHEMES.json"))
cols = ["UFE", "TFE", "MU", "OVR", "model_utility", "forget_Q_A_ROUGE", "retain_Q_A_ROUGE"]
# docs/results.md, tasks 1 and 2 (mean, std)
prev = {
 "joint":        [(66.84,1.80),(99.36,0.00),(13.58,0.98),(48.34,0.94),(0.106,0.008),(0.021,0.008),(1.000,0.000)],
 "alternate":    [(58.22,2.13),(98.70,1.19),(32.70,2.71),(55.58,0.53),(0.268,0.024),(0.028,0.009),(0.998,0.003)],
 "dualoptim":    [(59.49,2.97),(97.73,0.25),(39.70,2.37),(59.15,1.99),(0.333,0.022),(0.049,0.015),(1.000,0.000)],
 "doplus":       [(56.63,3.11),(97.74,0.58),(28.52,12.61),(52.85,5.38),(0.233,0.111),(0.108,0.045),(1.000,0.000)],
 "doplus-paper": [(56.01,2.21),(98.66,0.18),(37.81,1.51),(57.57,1.35),(0.315,0.014),(0.120,0.019),(1.000,0.000)],
}
prev_cos = {"alternate": (0.863,0.003), "dualoptim": (-0.004,0.005), "doplus": (0.183,0.032), "doplus-paper": (0.105,0.009)}
ufe_levels, mu_levels = [26.4, 37.0, 47.6], [42.4, 39.2, 35.9]
# tasks 1-2 trade-off: (mean, std, reached) per level; None = not reached by either
prev_mu_at_ufe = {
 "joint": [(38.30,5.60,2),(31.39,9.64,2),(24.48,13.68,2)], "alternate": [(42.96,0.70,2),(40.26,0.79,2),(37.57,0.87,2)],
 "dualoptim": [(44.26,1.45,2),(42.99,2.62,2),(41.72,3.78,2)], "doplus": [(38.27,2.41,2),(30.97,3.16,2),(30.10,5.19,2)],
 "doplus-paper": [(42.85,0.23,2),(39.95,1.11,2),(36.98,1.92,2)]}
prev_ufe_at_mu = {
 "joint": [(21.84,5.94,2),(27.76,9.40,2),(33.87,12.97,2)], "alternate": [(28.64,2.82,2),(41.23,3.23,2),(54.22,3.65,2)],
 "dualoptim": [(45.16,20.57,2),(46.83,None,1),(None,None,0)], "doplus": [(20.56,2.90,2),(25.23,3.38,2),(30.04,3.87,2)],
 "doplus-paper": [(28.27,1.39,2),(40.37,4.94,2),(46.77,None,1)]}
labels = {"joint": "Joint", "alternate": "Alternate", "dualoptim": "DO", "doplus": "DO+", "doplus-paper": "DO+ (paper rule)"}

def two(m, s):
    return [m - s / math.sqrt(2), m + s / math.sqrt(2)]

def prev_values(m, s, reached):
    if reached == 2: return two(m, s)
    if reached == 1: return [m]
    return []

def fmt(vals, spec):
    if not vals: return "not reached"
    m = statistics.mean(vals)
    return f"{m:{spec}} ± {statistics.stdev(vals):{spec}}" if len(vals) > 1 else f"{m:{spec}}"

run = {r["scheme"]: r for r in S["runs"].values()}
curves = S["tradeoff"]["curves"] if S.get("tradeoff") else {}
print("task 3 per run:")
for sch, r in run.items():
    v = r["values"]
    print(sch, {k: (round(v[k], 4) if isinstance(v.get(k), float) else v.get(k)) for k in v})
print()
print("| Method | UFE ↑ | TFE ↑ | MU ↑ | OVR ↑ | model_utility ↑ | forget ROUGE-L ↓ | retain ROUGE-L ↑ | update cos | task 3: UFE / MU / OVR |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for sch in prev:
    v = run[sch]["values"]
    cells = []
    for c, (m, s), spec in zip(cols, prev[sch], [".2f"]*4 + [".3f"]*3):
        cells.append(fmt(two(m, s) + [v[c]], spec))
    cos = "n/a" if sch not in prev_cos else fmt(two(*prev_cos[sch]) + [v["update_cosine"]], ".3f")
    print(f"| {labels[sch]} | " + " | ".join(cells) + f" | {cos} | {v['UFE']:.2f} / {v['MU']:.2f} / {v['OVR']:.2f} |")
print()
name = {sch: n for n, r in S["runs"].items() for sch in [r["scheme"]]}
for title, prevt, grid, falling in (("MU (%) at matched UFE", prev_mu_at_ufe, ufe_levels, False),
                                    ("UFE (%) at matched MU", prev_ufe_at_mu, mu_levels, True)):
    print(f"| {title} ↑ | " + " | ".join(f"{'UFE' if not falling else 'MU'} = {l}" for l in grid) + " |")
    print("| --- | ---: | ---: | ---: |")
    for sch in prev:
        c = curves[name[sch]]
        pts = [(mu, ufe) for ufe, mu in c] if falling else [tuple(p) for p in c]
        row = []
        for (m, s, k), level in zip(prevt[sch], grid):
            x = at_level(pts, level, falling)
            vals = prev_values(m, s, k) + ([x.value] if x.status == "reached" else [])
            t3 = f"{x.value:.1f}" if x.status == "reached" else x.status
            row.append(f"{fmt(vals, '.2f')} ({len(vals)}/3; task 3: {t3})")
        print(f"| {labels[sch]} | " + " | ".join(row) + " |")
    print()
print("task 3 curves:", json.dumps(curves))
print("task 3 train time s:", {s: round(r['values'].get('train_time_s', float('nan')), 1) for s, r in run.items()})
