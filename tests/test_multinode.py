"""Multi-node Ray: a head and a second node (two raylets, as on two machines), joined with
``asyncflow run --address``; pools go where their ``resources`` labels say, and a pool no node
can host fails at once with AF604 instead of waiting for a placement group forever.

The two nodes are started by ``ray.cluster_utils.Cluster`` on this machine: each is a real Ray
node (its own raylet and object store), the second joins the head's GCS like a remote machine
would. Each node carries a custom resource naming it; the pipeline's pools ask for them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("ray")
pytest.importorskip("torch")

pytestmark = pytest.mark.ray

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PIPELINE = """\
pipeline: two_nodes
models:
  policy:
    init: asyncflow.models:tiny_decoder
    args: {layers: 1, hidden: 32}
  reference: {copy_of: policy, frozen: true}
data:
  prompts:
    source: asyncflow.datasets:digits
    args: {n: 200, seed: 0}
    fields: [prompt, answer]
pools:
  rollout: {devices: 1, resources: {ROLLOUT_LABEL: 1}}
  train: {devices: 1, resources: {train_node: 1}}
step: {prompts_per_step: 4, samples_per_prompt: 4, steps: 3}
tasks:
  generate:
    kind: rollout
    engine: hf
    model: policy
    pool: rollout
    inputs: [prompt]
    outputs: [response, logprobs]
    args: {max_new_tokens: 4}
  score:
    kind: reward
    fn: asyncflow.rewards:digits_match
    inputs: [prompt, answer, response]
    outputs: [reward]
  ref:
    kind: logprob
    engine: hf
    model: reference
    pool: train
    inputs: [prompt, response]
    outputs: [ref_logprobs]
  advantage: {kind: advantage, estimator: grpo, inputs: [reward], outputs: [advantages]}
  update:
    kind: train
    engine: hf
    model: policy
    pool: train
    loss: grpo
    inputs: [prompt, response, logprobs, ref_logprobs, advantages]
    args: {lr: 1.0e-3}
sync:
  - {from: update, to: generate, max_staleness: 1}
"""


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True,
                head_node_args={"num_cpus": 2, "resources": {"train_node": 1}})
    second = c.add_node(num_cpus=1, resources={"rollout_node": 1})
    c.wait_for_nodes()
    try:
        yield c, c.head_node.node_id, second.node_id
    finally:
        c.shutdown()


def _run(tmp_path, address: str, label: str, timeout: float = 600):
    path = tmp_path / f"{label}.yaml"
    path.write_text(PIPELINE.replace("ROLLOUT_LABEL", label))
    out = tmp_path / f"run_{label}"
    env = {**os.environ, "PYTHONPATH": ROOT}
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "asyncflow.cli", "run", str(path), "--address",
                           address, "--out", str(out), "--quiet"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc, out, time.time() - t0


def test_pools_run_on_the_nodes_their_resources_name(cluster, tmp_path):
    c, head_id, second_id = cluster
    proc, out, _ = _run(tmp_path, c.address, "rollout_node")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    workers = json.loads((out / "workers.json").read_text())
    assert workers["generate/0"]["node"] == second_id  # the rollout pool: the second node
    assert workers["update/0"]["node"] == head_id  # the train pool: the head
    assert workers["ref/0"]["node"] == head_id
    assert {w["status"] for w in workers.values()} == {"stopped"}
    # on a cluster, core numbers of one node mean nothing on another: nobody is pinned
    assert not any("cpu_affinity" in w for w in workers.values())


def test_a_pool_no_node_can_host_fails_fast_and_located(cluster, tmp_path):
    c, _, _ = cluster
    proc, _, took = _run(tmp_path, c.address, "no_such_node", timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    text = proc.stdout + proc.stderr
    assert "AF604" in text and "pool 'rollout' needs 1 no_such_node" in text
    assert "no_such_node.yaml:13:3" in text  # the pool's key in the file
    assert "Traceback" not in text
    assert took < 60  # no placement-group wait (that would be Ray's 60 s or forever)
