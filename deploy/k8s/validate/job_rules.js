// The Job controller's rules for failed pods (batch/v1, Kubernetes >= 1.29
// where backoffLimitPerIndex is on by default; GA in 1.33), as documented in
// "Jobs: Handling Pod and container failures", "Pod failure policy" and
// "Backoff limit per index". jobOutcome() replays a list of pod failures
// against a Job spec and says what the controller does; validate.js uses it
// to check that the worker Job behaves as deploy/k8s/README.md promises.
'use strict';

const MAX_INT32 = 2147483647;

// Whether `rule` of spec.podFailurePolicy matches the failed `pod`
// ({exitCodes: {container: code}, conditions: [type...]}).
function ruleMatches(rule, pod) {
  if (rule.onExitCodes) {
    const { containerName, operator, values } = rule.onExitCodes;
    return Object.entries(pod.exitCodes || {}).some(([name, code]) => {
      if (containerName && containerName !== name) return false;
      // NotIn never matches a container that succeeded (exit 0).
      if (operator === 'NotIn') return code !== 0 && !values.includes(code);
      return values.includes(code);
    });
  }
  if (rule.onPodConditions) {
    return rule.onPodConditions.some((c) =>
      (c.status || 'True') === 'True' && (pod.conditions || []).includes(c.type));
  }
  return false;
}

// The first matching rule's action (rules are evaluated in order), or
// 'Count' (the default) when none matches.
function actionFor(spec, pod) {
  for (const rule of (spec.podFailurePolicy && spec.podFailurePolicy.rules) || []) {
    if (ruleMatches(rule, pod)) return rule.action;
  }
  return 'Count';
}

// Replays `failures` (pods failing one after the other, each
// {index, exitCodes, conditions}) while the other indexes run. Returns
//   {failed: bool, reason, failedIndexes: [..], othersTerminated: bool}
// failed: the Job ends Failed. othersTerminated: it ends at once, its
// running pods terminated (FailJob, backoffLimit or maxFailedIndexes
// exceeded); with a failed index but no such limit crossed, the other
// indexes run to the end and only then is the Job marked Failed.
function jobOutcome(spec, failures) {
  const perIndex = spec.backoffLimitPerIndex;
  // backoffLimit defaults to 6, or to MaxInt32 with backoffLimitPerIndex.
  const backoffLimit = spec.backoffLimit !== undefined ? spec.backoffLimit
    : (perIndex !== undefined ? MAX_INT32 : 6);
  const counted = new Map();  // index -> failures counted against it
  const failedIndexes = new Set();
  let total = 0;
  const stop = (reason) => ({ failed: true, reason, failedIndexes: [...failedIndexes], othersTerminated: true });
  for (const pod of failures) {
    if (failedIndexes.has(pod.index)) continue;  // a failed index is not retried
    const action = actionFor(spec, pod);
    if (action === 'Ignore') continue;           // not counted; the pod is replaced
    if (action === 'FailJob') return stop(`podFailurePolicy FailJob (exit ${JSON.stringify(pod.exitCodes)})`);
    if (action === 'FailIndex' && perIndex !== undefined) {
      failedIndexes.add(pod.index);
    } else {
      total++;
      if (total > backoffLimit) return stop(`backoffLimit ${backoffLimit} exceeded (${total} failed pods)`);
      if (perIndex !== undefined) {
        const n = (counted.get(pod.index) || 0) + 1;
        counted.set(pod.index, n);
        if (n > perIndex) failedIndexes.add(pod.index);
      }
    }
    if (spec.maxFailedIndexes !== undefined && failedIndexes.size > spec.maxFailedIndexes) {
      return stop(`maxFailedIndexes ${spec.maxFailedIndexes} exceeded (${failedIndexes.size} failed indexes)`);
    }
  }
  if (failedIndexes.size > 0) {
    return { failed: true, reason: 'FailedIndexes, once every other index is done', failedIndexes: [...failedIndexes], othersTerminated: false };
  }
  return { failed: false, reason: '', failedIndexes: [], othersTerminated: false };
}

// The Kubernetes documentation's own examples, replayed: if these disagree,
// jobOutcome() does not encode the documented rules.
function selfTest() {
  const problems = [];
  const expect = (name, got, want) => {
    for (const [k, v] of Object.entries(want)) {
      if (JSON.stringify(got[k]) !== JSON.stringify(v)) {
        problems.push(`${name}: ${k} = ${JSON.stringify(got[k])}, the documentation says ${JSON.stringify(v)}`);
      }
    }
  };
  const crash = (index, code = 1) => ({ index, exitCodes: { main: code } });
  // "backoffLimit: number of retries before considering a Job as failed";
  // default 6.
  expect('backoffLimit 0', jobOutcome({ backoffLimit: 0 }, [crash(3)]), { failed: true, othersTerminated: true });
  expect('default backoffLimit', jobOutcome({}, Array(6).fill(crash(0))), { failed: false });
  expect('default backoffLimit', jobOutcome({}, Array(7).fill(crash(0))), { failed: true });
  // job-backoff-limit-per-index-example.yaml: completions 10,
  // backoffLimitPerIndex 1, maxFailedIndexes 5, every even index fails:
  // "the Job fails as there is at least one failed index, yet all indexes
  // are executed as maxFailedIndexes is not exceeded".
  const even = [0, 2, 4, 6, 8].flatMap((i) => [crash(i), crash(i)]);
  expect('per-index example', jobOutcome({ completions: 10, backoffLimitPerIndex: 1, maxFailedIndexes: 5 }, even),
    { failed: true, othersTerminated: false, failedIndexes: [0, 2, 4, 6, 8] });
  // job-backoff-limit-per-index-failindex.yaml: index 0 exits 1 (one
  // retry), index 1 exits 42 (FailIndex: no retry).
  const failIndex = { backoffLimitPerIndex: 1, backoffLimit: 6, podFailurePolicy: { rules: [
    { action: 'FailIndex', onExitCodes: { containerName: 'main', operator: 'In', values: [42] } }] } };
  expect('FailIndex example', jobOutcome(failIndex, [crash(0), crash(1, 42)]), { failedIndexes: [1], othersTerminated: false });
  // Pod failure policy example: DisruptionTarget ignored, exit 42 FailJob.
  const policy = { podFailurePolicy: { rules: [
    { action: 'FailJob', onExitCodes: { containerName: 'main', operator: 'In', values: [42] } },
    { action: 'Ignore', onPodConditions: [{ type: 'DisruptionTarget' }] }] } };
  expect('Ignore', jobOutcome(policy, Array(20).fill({ index: 0, exitCodes: { main: 137 }, conditions: ['DisruptionTarget'] })), { failed: false });
  expect('FailJob', jobOutcome(policy, [crash(0, 42)]), { failed: true, othersTerminated: true });
  return problems;
}

module.exports = { jobOutcome, selfTest };
