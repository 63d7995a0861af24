"""The default takeover, picked by docs/failures.md's rule on the shared fault log: mecefo-plan
at slices of 1 and of 8 servers, recorded with its commit and load (config.py's default is held
to its pick by tests/test_plan.py).

Run: python -m benchmarks.default_pick [--trace LOG] [--slice-hosts 1,8] --json OUT
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: benchmarks/, not the repository, is on sys.path
  raise SystemExit('error: run it from the repository root as python -m benchmarks.'
                   + __file__.rpartition('/')[2].removesuffix('.py'))

import os

from benchmarks import common
from mecefo_jax.plan import cli

TRACE = 'benchmarks/traces/infinitehbd_days0-174.5.json'


def main(argv=None) -> dict:
  p = common.parser(__doc__)
  p.add_argument('--trace', default=TRACE)
  p.add_argument('--days', default='0:174.5')
  p.add_argument('--nodes', type=int, default=400)
  p.add_argument('--slice-hosts', default='1,8', help='the fleets: servers per slice')
  a = p.parse_args(argv)
  result = {**common.run_info(__spec__.name, argv), 'load_before': os.getloadavg()}
  fleets = {}
  for k in [int(x) for x in a.slice_hosts.split(',')]:
    planner_argv = ['--trace', a.trace, '--nodes', str(a.nodes), '--days', a.days,
                    '--slice-hosts', str(k)]
    plan = cli.plan(cli.parser().parse_args(planner_argv), planner_argv)
    print(cli.table(plan), f"\n({plan['runtime_s']:.0f} s)\n")
    fleets[str(k)] = plan
  result.update(fleets=fleets, load_after=os.getloadavg(),
                recommended={k: plan['recommended'] for k, plan in fleets.items()})
  rows = [{'slice hosts': k, 'recommended': plan['recommended'],
           'loss-eq r=inf %': plan['approaches'][plan['recommended']]['loss_equivalent_pct'],
           'limit %': plan['limit_pct']['r_inf'], 'runtime s': plan['runtime_s']}
          for k, plan in fleets.items()]
  common.emit(result, common.markdown_table(rows, list(rows[0])), a.json)
  return result


if __name__ == '__main__':
  main()
