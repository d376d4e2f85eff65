"""trainer.policy_rules: rules, their validation, and the one decision function both sides use."""

import pytest

from trainer.policy_rules import (
    Action,
    Budget,
    Facts,
    PolicyError,
    decide,
    default_decision,
    parse_rules,
    signal_name,
    stops_in_job,
)

RULES = [{"match": {"class": "nan_loss"}, "action": "stop", "after": 2},
         {"match": {"exit_code": 93}, "action": "stop"},
         {"match": {"reason": "OOMKilled"}, "action": "stop_keep"},
         {"match": {"signal": "kill"}, "action": "restart_job"}]


def test_it_parses_rules_and_round_trips_them():
    rules = parse_rules(RULES)
    assert [r.action for r in rules] == ["stop", "stop", "stop_keep", "restart_job"]
    assert rules[3].match.signal == "SIGKILL"
    assert parse_rules([r.to_dict() for r in rules]) == rules
    assert rules[0].words() == "nan_loss ×2 without progress → stop the job"


@pytest.mark.parametrize("rules, field", [
    ("stop", "failure_policy"),
    ([{"match": {"class": "nope"}, "action": "stop"}], "failure_policy[0].match.class"),
    ([{"match": {}, "action": "stop"}], "failure_policy[0].match"),
    ([{"match": {"colour": "red"}, "action": "stop"}], "failure_policy[0].match.colour"),
    ([{"match": {"exit_code": 0}, "action": "stop"}], "failure_policy[0].match.exit_code"),
    ([{"match": {"signal": "SIGNOPE"}, "action": "stop"}], "failure_policy[0].match.signal"),
    ([{"match": {"reason": "two words"}, "action": "stop"}], "failure_policy[0].match.reason"),
    ([{"match": {"class": "hang"}, "action": "explode"}], "failure_policy[0].action"),
    ([{"match": {"class": "hang"}, "action": "stop", "after": 0}], "failure_policy[0].after"),
    ([{"match": {"class": "hang"}, "action": "stop", "without_progress": "yes"}],
     "failure_policy[0].without_progress"),
    ([{"match": {"class": "process_killed"}, "action": "retry_in_process"}], "failure_policy[0].action"),
    ([{"match": {"class": "hang"}, "action": "stop"}, {"match": {"class": "hang"}, "action": "x"}],
     "failure_policy[1].action"),
])
def test_it_names_the_field_of_a_bad_rule(rules, field):
    with pytest.raises(PolicyError) as e:
        parse_rules(rules)
    assert field in e.value.errors, e.value.errors


def test_it_refuses_an_action_whose_layer_is_off():
    with pytest.raises(PolicyError, match="in-job restarts are off"):
        parse_rules([{"match": {"class": "hang"}, "action": "restart_in_job"}], in_job=False)
    with pytest.raises(PolicyError, match="job-level restarts are off"):
        parse_rules([{"match": {"class": "hang"}, "action": "restart_job"}], job_restart=False)


def test_a_capped_rule_acts_on_its_nth_match_and_the_default_before():
    rules = parse_rules(RULES)
    nan = Facts(fault_class="nan_loss")
    first = decide(rules, nan, [1, 0, 0, 0], Budget())
    assert (first.action, first.rule) == (Action.RETRY_IN_PROCESS, None)
    second = decide(rules, nan, [2, 0, 0, 0], Budget())
    assert (second.action, second.rule) == (Action.STOP, 0)
    assert second.why == "rule 1: nan_loss ×2 without progress → stop the job"


def test_it_matches_exit_codes_signals_and_reason_words():
    rules = parse_rules(RULES)
    assert decide(rules, Facts(fault_class="exception", exit_code=93), [0, 1, 0, 0], Budget()).rule == 1
    oom = Facts(fault_class="oom_killed", text="pod x: out of memory (OOMKilled, exit code 137)")
    assert decide(rules, oom, [0, 0, 1, 0], Budget()).action == Action.STOP_KEEP
    assert decide(rules, Facts(fault_class="oom_killed", text="OOMKilledX"), [0, 0, 1, 0], Budget()).rule is None
    killed = Facts(fault_class="process_killed", signal="SIGKILL")
    assert decide(rules, killed, [0, 0, 0, 1], Budget()).action == Action.RESTART_JOB


def test_a_restart_rule_whose_layer_is_used_up_falls_back_to_the_default():
    rules = parse_rules([{"match": {"class": "exception"}, "action": "restart_job"}])
    d = decide(rules, Facts(fault_class="exception"), [1], Budget(in_process=False, in_job=False, job_left=0))
    assert (d.action, d.rule) == (Action.STOP, None)


@pytest.mark.parametrize("cls, budget, action", [
    ("exception", Budget(), Action.RETRY_IN_PROCESS),
    ("nan_loss", Budget(in_process_left=0), Action.RESTART_IN_JOB),
    ("hang", Budget(in_process=False, in_job_left=0), Action.RESTART_JOB),
    ("process_killed", Budget(), Action.RESTART_IN_JOB),
    ("oom_killed", Budget(), Action.RESTART_JOB),
    ("node_lost", Budget(job_left=0), Action.STOP),
    ("exception", Budget(storm_left=0), Action.STOP),
    ("stalled", Budget(), Action.NOTIFY),
    ("image_pull", Budget(), Action.STOP),
    ("straggler", Budget(), Action.MARK),
])
def test_the_default_is_what_the_layers_do_today(cls, budget, action):
    d = default_decision(cls, budget)
    assert d.action == action and d.rule is None and d.why.startswith("default:")


def test_ft_launcher_stops_restarting_only_on_a_written_stop():
    rules = parse_rules(RULES)
    assert stops_in_job(rules, Facts(fault_class="exception", exit_code=93), [0, 1, 0, 0]).rule == 1
    assert stops_in_job(rules, Facts(fault_class="exception", exit_code=1), [0, 0, 0, 0]) is None
    assert stops_in_job((), Facts(fault_class="process_killed", signal="SIGKILL"), []) is None


def test_it_names_signals():
    assert signal_name(9) == signal_name("KILL") == signal_name("sigkill") == "SIGKILL"
    assert signal_name("NOPE") is None


def test_ft_launchers_hook_counts_matches_over_rounds_and_names_the_rule():
    from trainer.launcher_hooks import LauncherHooks
    from trainer.reporter import NullReporter

    hooks = LauncherHooks(reporter=NullReporter(), attempt=0, app_store=None, in_job=True, rules=parse_rules([
        {"match": {"class": "exception"}, "action": "stop", "after": 2},
        {"match": {"signal": "SIGSEGV"}, "action": "restart_job"}]))
    failed = {1: {"exitcode": 1, "signal": None, "pid": 10, "local_rank": 1}}
    assert hooks._policy(failed, {}) is None  # the first exception: ft_launcher restarts the group
    assert hooks._policy(failed, {}).why == "rule 1: exception ×2 without progress → stop the job"
    segv = {0: {"exitcode": -11, "signal": "SIGSEGV", "pid": 11, "local_rank": 0}}
    assert hooks._policy(segv, {}).action == Action.RESTART_JOB
