#!/usr/bin/env bash
# Stop the cluster from setup.sh: cancel jobs, `scontrol shutdown`, SIGKILL what is left by PID
# file, and remove the node names it added to /etc/hosts. Safe to run twice.
LAB=${MEGATRON_RL_SLURM_LAB:-/tmp/megatron-rl-slurm}
export SLURM_CONF=$LAB/etc/slurm.conf
if [[ -f "$SLURM_CONF" ]]; then
  timeout 10 scancel --full --user=root 2>/dev/null || true
  timeout 10 scontrol shutdown 2>/dev/null || true
  for _ in $(seq 1 100); do  # up to 10 s
    alive=0
    for p in "$LAB"/run/*.pid; do [[ -f "$p" ]] && kill -0 "$(cat "$p")" 2>/dev/null && alive=1; done
    [[ $alive == 0 ]] && break
    sleep 0.1
  done
  for p in "$LAB"/run/*.pid; do [[ -f "$p" ]] && kill -9 "$(cat "$p")" 2>/dev/null; rm -f "$p"; done
fi
# The node names are shared by every test cluster on this host: kept while another one runs
if grep -q "# megatron-rl-slurm-test" /etc/hosts 2>/dev/null && ! pgrep -x slurmd >/dev/null; then
  # /etc/hosts may be a bind mount: rewrite it in place rather than replacing the file.
  kept=$(grep -v "# megatron-rl-slurm-test" /etc/hosts)
  printf '%s\n' "$kept" > /etc/hosts
fi
exit 0
