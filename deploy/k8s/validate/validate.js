#!/usr/bin/env node
// Offline validation of the Kubernetes manifests in deploy/k8s.
//
//   node deploy/k8s/validate/validate.js                      # every deploy/k8s/base/*.yaml
//   node validate.js a.yaml b.yaml ...                        # these files, as one set
//   node validate.js --kubectl-log=LOG a.yaml ...             # first apply the merge patches
//                                                             # recorded in LOG (see below)
//   node validate.js --expect-invalid bad1.yaml bad2.yaml     # each file must be rejected
//   node validate.js --self-test                              # job_rules.js vs the k8s docs' examples
//
// Every YAML document is checked three ways:
//  1. Schema: the kubernetes-models class for its apiVersion/kind
//     (`new StatefulSet(obj).validate()`), i.e. the Kubernetes OpenAPI schema
//     that kubernetes-models bundles: types, enums, formats, required fields.
//  2. Unknown fields, which (1) lets through because the bundled schemas do
//     not set additionalProperties: false. kubernetes-models ships its schemas
//     compiled to ajv standalone validators (kubernetes-models/_schemas/*.js,
//     @kubernetes-models/apimachinery/_schemas/*.js); each one reads exactly the
//     properties its schema declares. So the same validator runs once more over
//     a Proxy of the document that records, for every object, which keys the
//     schema read. A key no schema read is an unknown field (reported with its
//     path). An object whose keys the validator enumerates (a map such as
//     labels, ConfigMap data or resource limits: additionalProperties) accepts
//     any key; an object no schema looked into (free-form) is not checked.
//  3. Cross-references within the set: selectors match the pod template
//     labels, a StatefulSet's serviceName is a headless Service of the set,
//     ConfigMaps named by envFrom/configMapKeyRef exist (with the key), named
//     probe ports exist; and pstrain's own rules for the ConfigMap
//     "pstrain-config", StatefulSet "ps" and Job "worker": NUM_SHARDS ==
//     replicas == entries of PS_HOSTS (ps-<i>.<service>...:PS_PORT), NUM_WORKERS
//     == parallelism == completions <= MAX_WORKERS (when set), MODE
//     sync|async; a grpc probe's port is one the container declares; the
//     worker Job, replayed under the Job controller's failure rules
//     (job_rules.js), survives a crashing worker and fails fast on exit 2;
//     ps checkpoints go to CHECKPOINT_DIR on one ReadWriteMany claim; a
//     PodMonitor selects the pods and names their port; a kustomization
//     lists every manifest of its directory. Replicated shards (REPLICAS
//     R > 1 in pstrain-config; ../replicas/, ../make_replicas.js): instead
//     of StatefulSet "ps", one StatefulSet "ps-<s>" per shard with replicas
//     == R, its pods labelled pstrain.io/shard=<s> and kept apart by a
//     required podAntiAffinity term (topologyKey kubernetes.io/hostname)
//     that selects them and no other shard's pods; ps_server given
//     --replicas/--replica_index/--replica_hosts; PS_HOSTS entry s ==
//     ps-<s>-0.<service>:PORT|...|ps-<s>-<R-1>.<service>:PORT; the Service
//     publishes not-ready addresses; no TLS (ps_server refuses it).
//
// --kubectl-log=LOG: LOG is what a stand-in kubectl recorded for
// scale_workers.sh: each call's arguments one per line, then a line "<<end>>".
// Calls "patch <type> <name> ... -p <json>" (merge patches) are applied to the
// matching documents before the checks; other calls are ignored.
//
// --expect-invalid: every file given must produce at least one error, and
// every line "# expect: TEXT" in a file must be a substring of one of its
// errors. Exit status 0 when so.
//
// Exit status: 0 valid; 1 invalid (or an --expect-invalid file accepted);
// 2 usage or environment error (e.g. node_modules missing: run
// `npm ci --prefix deploy/k8s/validate`, which deploy/setup.sh does).
'use strict';

const fs = require('fs');
const path = require('path');

function die(message) {
  process.stderr.write(`validate.js: ${message}\n`);
  process.exit(2);
}

let yaml;
try {
  yaml = require('js-yaml');
  require.resolve('kubernetes-models/package.json');
} catch (e) {
  die(`cannot load js-yaml / kubernetes-models (${e.message.split('\n')[0]}); ` +
      `run: npm ci --prefix deploy/k8s/validate   (deploy/setup.sh does it)`);
}
const modelsVersion = require('kubernetes-models/package.json').version;
const { jobOutcome, selfTest } = require('./job_rules.js');

// --- Arguments ------------------------------------------------------------------

let expectInvalid = false;
let kubectlLog = null;
const files = [];
for (const arg of process.argv.slice(2)) {
  if (arg === '--self-test') {
    // job_rules.js against the Kubernetes documentation's examples.
    const problems = selfTest();
    for (const p of problems) process.stdout.write(`FAIL job rules: ${p}\n`);
    if (problems.length === 0) process.stdout.write('ok   job rules agree with the documented examples\n');
    process.exit(problems.length === 0 ? 0 : 1);
  }
  if (arg === '--expect-invalid') expectInvalid = true;
  else if (arg.startsWith('--kubectl-log=')) kubectlLog = arg.slice('--kubectl-log='.length);
  else if (arg === '-h' || arg === '--help') {
    const text = fs.readFileSync(__filename, 'utf8').split('\n');
    const end = text.findIndex((l) => l.startsWith("'use strict'"));
    process.stdout.write(text.slice(1, end).map((l) => l.replace(/^\/\/ ?/, '')).join('\n') + '\n');
    process.exit(0);
  } else if (arg.startsWith('--')) die(`unknown option ${arg} (see --help)`);
  else files.push(arg);
}
if (files.length === 0) {
  const dir = path.resolve(__dirname, '..', 'base');
  for (const name of fs.readdirSync(dir).sort()) {
    if (/\.ya?ml$/.test(name)) files.push(path.join(dir, name));
  }
  if (files.length === 0) die(`no *.yaml in ${dir}`);
}

// --- Loading ----------------------------------------------------------------------

// Returns [{file, index, obj}] for every non-empty document; YAML errors are
// reported as errors of the file.
function loadDocs(file, errors) {
  let text;
  try {
    text = fs.readFileSync(file, 'utf8');
  } catch (e) {
    die(`cannot read ${file}: ${e.message}`);
  }
  const docs = [];
  try {
    yaml.loadAll(text, (obj) => {
      if (obj !== null && obj !== undefined) docs.push({ file, index: docs.length, obj });
    }, { filename: file, schema: yaml.CORE_SCHEMA });
  } catch (e) {
    errors.push({ file, where: file, message: `YAML: ${e.message.split('\n')[0]}` });
  }
  return docs;
}

function docLabel(doc) {
  const o = doc.obj || {};
  const name = (o.metadata && o.metadata.name) || '?';
  return `${path.basename(doc.file)}#${doc.index} ${o.kind || '?'}/${name}`;
}

// --- 1. Schema, via the kubernetes-models classes -------------------------------------

function modelClass(apiVersion, kind) {
  if (typeof apiVersion !== 'string' || typeof kind !== 'string' ||
      !/^[a-z0-9.]+(\/[a-z0-9]+)?$/.test(apiVersion) || !/^[A-Za-z0-9]+$/.test(kind)) {
    return null;
  }
  // kubernetes-models/<group>/<version>/<Kind>, core group as kubernetes-models/v1/<Kind>;
  // the Prometheus Operator's CRDs from @kubernetes-models/prometheus-operator.
  const pkg = apiVersion.startsWith('monitoring.coreos.com/')
    ? '@kubernetes-models/prometheus-operator' : 'kubernetes-models';
  try {
    const mod = require(`${pkg}/${apiVersion}/${kind}`);
    return mod[kind] || null;
  } catch (e) {
    if (e.code === 'MODULE_NOT_FOUND' || e.code === 'ERR_PACKAGE_PATH_NOT_EXPORTED') return null;
    throw e;
  }
}

// A kustomization is kustomize's, not an API object: the fields used here,
// resources that exist, and (for the directory's own kustomization) every
// manifest of the directory listed, so `kubectl apply -k` applies them all.
const KUSTOMIZE_API = 'kustomize.config.k8s.io/v1beta1';
function kustomizationErrors(doc) {
  const o = doc.obj;
  const errors = [];
  const known = new Set(['apiVersion', 'kind', 'resources', 'images', 'namespace', 'labels', 'commonLabels', 'patches']);
  for (const key of Object.keys(o)) {
    if (!known.has(key)) errors.push({ path: `/${key}`, message: `unknown field "${key}"` });
  }
  const dir = path.dirname(doc.file);
  const resources = Array.isArray(o.resources) ? o.resources : [];
  if (resources.length === 0) errors.push({ path: '/resources', message: 'no resources' });
  resources.forEach((r, i) => {
    const target = path.resolve(dir, String(r));
    const ok = fs.existsSync(target) && (fs.statSync(target).isFile() ||
      ['kustomization.yaml', 'kustomization.yml', 'Kustomization'].some((k) => fs.existsSync(path.join(target, k))));
    if (!ok) errors.push({ path: `/resources/${i}`, message: `"${r}" is neither a file nor a directory with a kustomization` });
  });
  const listed = new Set(resources.map((r) => path.resolve(dir, String(r))));
  for (const name of fs.readdirSync(dir)) {
    if (!/\.ya?ml$/.test(name) || /^kustomization\.ya?ml$/.test(name)) continue;
    if (!listed.has(path.resolve(dir, name))) {
      errors.push({ path: '/resources', message: `${name} is not listed: kubectl apply -k would leave it out` });
    }
  }
  (Array.isArray(o.images) ? o.images : []).forEach((img, i) => {
    if (!img || typeof img.name !== 'string') errors.push({ path: `/images/${i}/name`, message: 'an image entry needs a name' });
  });
  return errors;
}

function schemaErrors(doc) {
  const o = doc.obj;
  if (typeof o !== 'object' || Array.isArray(o)) return [{ path: '', message: 'document is not a mapping' }];
  if (o.apiVersion === KUSTOMIZE_API && o.kind === 'Kustomization') return kustomizationErrors(doc);
  const Cls = modelClass(o.apiVersion, o.kind);
  if (!Cls) {
    return [{ path: '', message: `unknown apiVersion/kind ${o.apiVersion}/${o.kind} (kubernetes-models ${modelsVersion})` }];
  }
  try {
    new Cls(o).validate();
    return [];
  } catch (e) {
    if (!Array.isArray(e.errors)) throw e;
    return e.errors.map((err) => {
      let message = err.message || err.keyword;
      if (err.keyword === 'required') message = `missing required field "${err.params.missingProperty}"`;
      else if (err.keyword === 'enum') message += `: ${JSON.stringify(err.params.allowedValues)}`;
      return { path: err.instancePath || '', message };
    });
  }
}

// --- 2. Unknown fields --------------------------------------------------------------

function pointerEscape(key) {
  return String(key).replace(/~/g, '~0').replace(/\//g, '~1');
}

// Wraps value (recursively, lazily) in Proxies that record property reads.
function track(value, ptr, records) {
  if (value === null || typeof value !== 'object') return value;
  const rec = { ptr, value, read: new Set(), enumerated: false, touched: false };
  records.push(rec);
  const children = new Map();
  return new Proxy(value, {
    get(target, prop, receiver) {
      rec.touched = true;
      if (typeof prop !== 'string') return Reflect.get(target, prop, receiver);
      rec.read.add(prop);
      if (!Object.prototype.hasOwnProperty.call(target, prop)) return Reflect.get(target, prop, receiver);
      if (!children.has(prop)) children.set(prop, track(target[prop], `${ptr}/${pointerEscape(prop)}`, records));
      return children.get(prop);
    },
    has(target, prop) {
      rec.touched = true;
      if (typeof prop === 'string') rec.read.add(prop);
      return Reflect.has(target, prop);
    },
    ownKeys(target) {
      rec.touched = true;
      rec.enumerated = true;
      return Reflect.ownKeys(target);
    },
    getOwnPropertyDescriptor(target, prop) {
      rec.touched = true;
      if (typeof prop === 'string') rec.read.add(prop);
      return Reflect.getOwnPropertyDescriptor(target, prop);
    },
  });
}

function unknownFieldErrors(doc) {
  const o = doc.obj;
  const Cls = modelClass(o && o.apiVersion, o && o.kind);
  if (!Cls) return [];
  const records = [];
  const root = track(o, '', records);
  try {
    // The class's validate() runs its bundled schema validator on `this`.
    Cls.prototype.validate.call(root);
  } catch (e) {
    if (!Array.isArray(e.errors)) throw e;  // schema errors are reported by schemaErrors()
  }
  const errors = [];
  for (const rec of records) {
    if (Array.isArray(rec.value) || rec.enumerated || !rec.touched) continue;
    for (const key of Object.keys(rec.value)) {
      if (!rec.read.has(key)) {
        errors.push({ path: `${rec.ptr}/${pointerEscape(key)}`, message: `unknown field "${key}"` });
      }
    }
  }
  return errors;
}

// --- 3. Cross-references and pstrain's rules ----------------------------------------------

function get(obj, ...keys) {
  let v = obj;
  for (const k of keys) {
    if (v === null || typeof v !== 'object') return undefined;
    v = v[k];
  }
  return v;
}

function crossErrors(docs) {
  const errors = [];
  const byKey = new Map();
  const add = (doc, p, message) => errors.push({ doc, path: p, message });
  for (const doc of docs) {
    const o = doc.obj;
    if (!o || typeof o !== 'object' || o.kind === 'Kustomization') continue;
    const name = get(o, 'metadata', 'name');
    if (typeof name !== 'string' || name === '') {
      add(doc, '/metadata/name', 'missing metadata.name');
      continue;
    }
    const key = `${o.kind}/${name}`;
    if (byKey.has(key)) add(doc, '/metadata/name', `duplicate ${key} (also ${docLabel(byKey.get(key))})`);
    else byKey.set(key, doc);
  }
  const find = (kind, name) => byKey.get(`${kind}/${name}`);

  const subsetOf = (sel, labels) => Object.entries(sel || {}).every(([k, v]) => labels && labels[k] === v);

  for (const doc of docs) {
    const o = doc.obj;
    if (!o || typeof o !== 'object') continue;
    const template = get(o, 'spec', 'template');
    const tmplLabels = get(template, 'metadata', 'labels') || {};
    if (['StatefulSet', 'Deployment', 'DaemonSet', 'ReplicaSet'].includes(o.kind) ||
        (o.kind === 'Job' && get(o, 'spec', 'selector'))) {
      const sel = get(o, 'spec', 'selector', 'matchLabels');
      if (sel && !subsetOf(sel, tmplLabels)) {
        add(doc, '/spec/selector/matchLabels', 'selector does not match the pod template labels');
      }
    }
    if (o.kind === 'StatefulSet') {
      const svcName = get(o, 'spec', 'serviceName');
      const svc = svcName && find('Service', svcName);
      if (!svc) add(doc, '/spec/serviceName', `no Service "${svcName}" in the set`);
      else {
        if (get(svc.obj, 'spec', 'clusterIP') !== 'None') {
          add(svc, '/spec/clusterIP', `Service of StatefulSet ${get(o, 'metadata', 'name')} must be headless (clusterIP: None)`);
        }
        if (!subsetOf(get(svc.obj, 'spec', 'selector'), tmplLabels)) {
          add(svc, '/spec/selector', `selector does not match the pods of StatefulSet ${get(o, 'metadata', 'name')}`);
        }
      }
    }
    if (o.kind === 'Job' && get(o, 'spec', 'completionMode') === 'Indexed') {
      const c = get(o, 'spec', 'completions');
      const p = get(o, 'spec', 'parallelism');
      if (c === undefined) add(doc, '/spec/completions', 'an Indexed Job needs completions');
      else if (p !== undefined && p !== c) {
        add(doc, '/spec/parallelism', `parallelism ${p} != completions ${c} (one pod per worker index; scaling an Indexed Job needs them equal)`);
      }
    }
    // Pod spec references.
    const podSpec = get(template, 'spec');
    if (!podSpec || typeof podSpec !== 'object') continue;
    for (const group of ['initContainers', 'containers']) {
      const list = podSpec[group];
      if (!Array.isArray(list)) continue;
      list.forEach((c, i) => {
        const base = `/spec/template/spec/${group}/${i}`;
        (c.envFrom || []).forEach((ef, j) => {
          const ref = ef && ef.configMapRef;
          if (ref && !ref.optional && !find('ConfigMap', ref.name)) {
            add(doc, `${base}/envFrom/${j}/configMapRef/name`, `no ConfigMap "${ref.name}" in the set`);
          }
        });
        (c.env || []).forEach((ev, j) => {
          const ref = get(ev, 'valueFrom', 'configMapKeyRef');
          if (!ref || ref.optional) return;
          const cm = find('ConfigMap', ref.name);
          if (!cm) add(doc, `${base}/env/${j}/valueFrom/configMapKeyRef`, `no ConfigMap "${ref.name}" in the set`);
          else if (!(ref.key in (get(cm.obj, 'data') || {}))) {
            add(doc, `${base}/env/${j}/valueFrom/configMapKeyRef/key`, `ConfigMap "${ref.name}" has no key "${ref.key}"`);
          }
        });
        const portNames = new Set((c.ports || []).map((p) => p && p.name).filter(Boolean));
        const portNumbers = new Set((c.ports || []).map((p) => p && p.containerPort));
        for (const probe of ['readinessProbe', 'livenessProbe', 'startupProbe']) {
          for (const kind of ['tcpSocket', 'httpGet']) {
            const port = get(c, probe, kind, 'port');
            if (typeof port === 'string' && !portNames.has(port)) {
              add(doc, `${base}/${probe}/${kind}/port`, `no container port named "${port}"`);
            }
          }
          // grpc probes take a number only: it must be one the container declares.
          const grpcPort = get(c, probe, 'grpc', 'port');
          if (typeof grpcPort === 'number' && !portNumbers.has(grpcPort)) {
            add(doc, `${base}/${probe}/grpc/port`, `no containerPort ${grpcPort} for the grpc probe`);
          }
        }
      });
    }
  }

  // pstrain: the ConfigMap, the servers and the workers agree.
  const cm = find('ConfigMap', 'pstrain-config');
  if (cm) {
    const data = get(cm.obj, 'data') || {};
    const int = (k) => (/^[1-9][0-9]*$/.test(String(data[k])) ? Number(data[k]) : NaN);
    for (const k of ['MODE', 'NUM_SHARDS', 'NUM_WORKERS', 'PS_PORT', 'PS_HOSTS']) {
      if (!(k in data)) add(cm, `/data/${k}`, `pstrain-config has no ${k}`);
    }
    if ('MODE' in data && !['sync', 'async'].includes(data.MODE)) add(cm, '/data/MODE', `MODE must be sync or async, not "${data.MODE}"`);
    const shards = int('NUM_SHARDS');
    const workers = int('NUM_WORKERS');
    if ('NUM_SHARDS' in data && Number.isNaN(shards)) add(cm, '/data/NUM_SHARDS', 'NUM_SHARDS must be a positive integer');
    if ('NUM_WORKERS' in data && Number.isNaN(workers)) add(cm, '/data/NUM_WORKERS', 'NUM_WORKERS must be a positive integer');
    if ('MAX_WORKERS' in data) {
      const max = int('MAX_WORKERS');
      if (Number.isNaN(max)) add(cm, '/data/MAX_WORKERS', 'MAX_WORKERS must be a positive integer');
      else if (!Number.isNaN(workers) && max < workers) {
        add(cm, '/data/MAX_WORKERS', `NUM_WORKERS ${data.NUM_WORKERS} > MAX_WORKERS ${data.MAX_WORKERS} (the servers refuse worker ids >= MAX_WORKERS)`);
      }
    }
    // The servers: StatefulSet "ps", pod ps-<s> = shard s (REPLICAS 1, the
    // default); or, with REPLICAS R > 1 (replicas/, make_replicas.js), one
    // StatefulSet "ps-<s>" per shard of R pods, pod ps-<s>-<r> = replica r.
    let R = 1;
    if ('REPLICAS' in data) {
      R = int('REPLICAS');
      if (Number.isNaN(R) || R > 5) {
        add(cm, '/data/REPLICAS', `REPLICAS must be an integer in [1, 5] (ps_server --replicas), not "${data.REPLICAS}"`);
        R = NaN;
      }
    }
    const shardSetName = /^ps-([0-9]+)$/;
    const shardSets = docs.filter((d) => d.obj && d.obj.kind === 'StatefulSet' &&
      shardSetName.test(String(get(d.obj, 'metadata', 'name'))));
    const psSets = [];  // [shard or -1 for all, doc]
    if (R === 1) {
      const ps = find('StatefulSet', 'ps');
      if (!ps) add(cm, '', 'no StatefulSet "ps" (the servers) in the set');
      else {
        const replicas = get(ps.obj, 'spec', 'replicas');
        if (replicas !== shards) add(ps, '/spec/replicas', `replicas ${replicas} != NUM_SHARDS ${data.NUM_SHARDS} of pstrain-config`);
        psSets.push([-1, ps]);
      }
      for (const d of shardSets) {
        add(d, '/metadata/name', `StatefulSet ${get(d.obj, 'metadata', 'name')} looks like a shard's replica set (make_replicas.js), but pstrain-config has no REPLICAS > 1`);
      }
    } else if (R > 1) {
      const ps = find('StatefulSet', 'ps');
      if (ps) {
        add(ps, '/metadata/name', `StatefulSet "ps" runs one server per shard, but REPLICAS is ${R}: ` +
          'the replicated overlay (replicas/, make_replicas.js) has one StatefulSet ps-<shard> per shard instead');
      }
      for (let sh = 0; sh < (Number.isNaN(shards) ? 0 : shards); sh++) {
        const d = find('StatefulSet', `ps-${sh}`);
        if (!d) add(cm, '', `no StatefulSet "ps-${sh}" (the ${R} replicas of shard ${sh}) in the set`);
        else psSets.push([sh, d]);
      }
      for (const d of shardSets) {
        const n = Number(shardSetName.exec(get(d.obj, 'metadata', 'name'))[1]);
        if (!(n < shards)) add(d, '/metadata/name', `StatefulSet ps-${n}: shard ${n} >= NUM_SHARDS ${data.NUM_SHARDS}`);
      }
      const serverFlags = String(data.SERVER_EXTRA_FLAGS || '');
      if (/--tls_cert\b/.test(serverFlags) && !/--(tls_client_ca|replica_tls_ca)\b/.test(serverFlags)) {
        add(cm, '/data/SERVER_EXTRA_FLAGS', `--tls_cert with REPLICAS ${R} needs --replica_tls_ca or --tls_client_ca: the replicas call each other over TLS and check each other's certificates by it (ps_server exits 2 without)`);
      }
      const serviceErrors = new Set();
      for (const [sh, d] of psSets) {
        const replicas = get(d.obj, 'spec', 'replicas');
        if (replicas !== R) add(d, '/spec/replicas', `replicas ${replicas} != REPLICAS ${data.REPLICAS} of pstrain-config (the replicas of shard ${sh})`);
        const labels = get(d.obj, 'spec', 'template', 'metadata', 'labels') || {};
        if (labels[SHARD_LABEL] !== String(sh)) {
          add(d, '/spec/template/metadata/labels', `the pods of shard ${sh} need the label ${SHARD_LABEL}: "${sh}" (their anti-affinity selects it)`);
        }
        for (const [p, e] of antiAffinityErrors(d.obj, sh, psSets.filter(([o]) => o !== sh), shards * R)) add(d, p, e);
        const container = (get(d.obj, 'spec', 'template', 'spec', 'containers') || [])[0] || {};
        const command = [...(container.command || []), ...(container.args || [])].join(' ');
        for (const flag of ['--replicas="$REPLICAS"', '--replica_index=', '--replica_hosts=']) {
          if (!command.includes(flag)) {
            add(d, '/spec/template/spec/containers/0/args', `ps_server runs without ${flag}: each replica would hold the shard alone`);
          }
        }
        const svc = find('Service', get(d.obj, 'spec', 'serviceName'));
        if (svc && get(svc.obj, 'spec', 'publishNotReadyAddresses') !== true && !serviceErrors.has(svc)) {
          serviceErrors.add(svc);
          add(svc, '/spec/publishNotReadyAddresses', 'the Service of replicated shards must publish not-ready addresses ' +
            '(publishNotReadyAddresses: true): a replica tells a dead peer by its port refusing connections, which needs its name to resolve');
        }
      }
    }
    if (psSets.length > 0 && !Number.isNaN(R)) {
      // PS_HOSTS: shard s's entry names its servers, replicas joined by '|'.
      const serviceOf = (sh) => get((psSets.find(([o]) => o === sh || o === -1) || psSets[0])[1].obj, 'spec', 'serviceName');
      const hosts = String(data.PS_HOSTS || '').split(',').filter((h) => h !== '');
      if (hosts.length !== shards) add(cm, '/data/PS_HOSTS', `PS_HOSTS has ${hosts.length} entries, NUM_SHARDS is ${data.NUM_SHARDS}`);
      const hostOk = (h, want) => {
        const m = /^([^:|]+):([0-9]+)$/.exec(h);
        return m && (m[1] === want || m[1].startsWith(`${want}.`)) && m[2] === String(data.PS_PORT);
      };
      hosts.forEach((h, i) => {
        const parts = h.split('|');
        if (parts.length !== R) {
          add(cm, '/data/PS_HOSTS', `entry ${i} "${h}" lists ${parts.length} replica(s) (joined by '|'), REPLICAS is ${R}`);
        } else if (R === 1) {
          const want = `ps-${i}.${serviceOf(i)}`;
          if (!hostOk(h, want)) {
            add(cm, '/data/PS_HOSTS', `entry ${i} "${h}" is not ${want}[.<namespace>.svc...]:${data.PS_PORT} (shard ${i} of StatefulSet ps)`);
          }
        } else {
          parts.forEach((part, r) => {
            const want = `ps-${i}-${r}.${serviceOf(i)}`;
            if (!hostOk(part, want)) {
              add(cm, '/data/PS_HOSTS', `entry ${i}, replica ${r}: "${part}" is not ${want}[.<namespace>.svc...]:${data.PS_PORT} (pod ${r} of StatefulSet ps-${i})`);
            }
          });
        }
      });
    }
    for (const [, d] of psSets) {
      const containerPorts = (get(d.obj, 'spec', 'template', 'spec', 'containers') || [])
        .flatMap((c) => (c.ports || []).map((p) => p.containerPort));
      if (!containerPorts.includes(Number(data.PS_PORT))) {
        add(d, '/spec/template/spec/containers', `no containerPort ${data.PS_PORT} (PS_PORT of pstrain-config)`);
      }
      for (const [p, e] of checkpointErrors(d.obj, data, (name) => find('PersistentVolumeClaim', name))) add(d, p, e);
    }
    const job = find('Job', 'worker');
    if (!job) add(cm, '', 'no Job "worker" (the workers) in the set');
    else {
      for (const f of ['parallelism', 'completions']) {
        const v = get(job.obj, 'spec', f);
        if (v !== workers) add(job, `/spec/${f}`, `${f} ${v} != NUM_WORKERS ${data.NUM_WORKERS} of pstrain-config`);
      }
      if (get(job.obj, 'spec', 'completionMode') !== 'Indexed') {
        add(job, '/spec/completionMode', 'the worker Job must be Indexed (worker id = JOB_COMPLETION_INDEX)');
      }
      for (const e of workerJobFailureErrors(get(job.obj, 'spec') || {})) add(job, '/spec', e);
    }
  }

  // A PodMonitor/ServiceMonitor must select pods of the set by labels and
  // name a port their containers declare.
  for (const doc of docs) {
    const o = doc.obj;
    if (!o || o.kind !== 'PodMonitor') continue;
    const sel = get(o, 'spec', 'selector', 'matchLabels');
    const pods = docs.filter((d) => d.obj && get(d.obj, 'spec', 'template', 'spec', 'containers') &&
      subsetOf(sel, get(d.obj, 'spec', 'template', 'metadata', 'labels')));
    if (pods.length === 0) add(doc, '/spec/selector', 'selects no pods of the set');
    (get(o, 'spec', 'podMetricsEndpoints') || []).forEach((ep, i) => {
      for (const d of pods) {
        const ports = (get(d.obj, 'spec', 'template', 'spec', 'containers') || [])
          .flatMap((c) => (c.ports || []).map((p) => p.name));
        if (!ports.includes(ep.port)) add(doc, `/spec/podMetricsEndpoints/${i}/port`, `${docLabel(d)} has no container port named "${ep.port}"`);
      }
    });
  }
  return errors;
}

// The label that tells a shard's replicas (deploy/k8s/make_replicas.js).
const SHARD_LABEL = 'pstrain.io/shard';

// Whether a LabelSelector selects a pod with these labels (null: none).
function selects(selector, labels) {
  if (!selector || typeof selector !== 'object') return false;
  const has = (k) => Object.prototype.hasOwnProperty.call(labels, k);
  if (!Object.entries(selector.matchLabels || {}).every(([k, v]) => has(k) && labels[k] === v)) return false;
  return (selector.matchExpressions || []).every((e) => {
    const values = (e && e.values) || [];
    switch (e && e.operator) {
      case 'In': return has(e.key) && values.includes(labels[e.key]);
      case 'NotIn': return !has(e.key) || !values.includes(labels[e.key]);
      case 'Exists': return has(e.key);
      case 'DoesNotExist': return !has(e.key);
      default: return false;
    }
  });
}

// A pod affinity term's selector as the API server completes it for a pod
// with these labels: matchLabelKeys become "key In (the pod's value)".
function termSelector(term, podLabels) {
  const selector = (term && term.labelSelector) || null;
  const keys = ((term && term.matchLabelKeys) || []).filter((k) => k in podLabels);
  if (!selector || keys.length === 0) return selector;
  return {
    matchLabels: selector.matchLabels,
    matchExpressions: [...(selector.matchExpressions || []),
      ...keys.map((k) => ({ key: k, operator: 'In', values: [podLabels[k]] }))],
  };
}

// A shard's replicas must repel each other per node (required anti-affinity
// on kubernetes.io/hostname selecting their own pods), and only each other:
// a term that also selects other shards' pods would ask for a node per pod.
function antiAffinityErrors(set, shard, others, pods) {
  const errors = [];
  const labels = get(set, 'spec', 'template', 'metadata', 'labels') || {};
  const base = '/spec/template/spec/affinity/podAntiAffinity';
  const anti = get(set, 'spec', 'template', 'spec', 'affinity', 'podAntiAffinity') || {};
  const required = Array.isArray(anti.requiredDuringSchedulingIgnoredDuringExecution)
    ? anti.requiredDuringSchedulingIgnoredDuringExecution : [];
  const apart = required.some((t) => t && t.topologyKey === 'kubernetes.io/hostname' &&
    !t.namespaceSelector && !(t.namespaces || []).length && selects(termSelector(t, labels), labels));
  if (!apart) {
    errors.push([`${base}/requiredDuringSchedulingIgnoredDuringExecution`,
      `no required podAntiAffinity term with topologyKey kubernetes.io/hostname selecting the pods of shard ${shard} ` +
      `(${SHARD_LABEL}: "${shard}"): two replicas of the shard could run on one node` +
      (anti.preferredDuringSchedulingIgnoredDuringExecution ? ' (preferredDuringScheduling is a preference, not a guarantee)' : '')]);
  }
  required.forEach((t, i) => {
    for (const [otherShard, other] of others) {
      const otherLabels = get(other.obj, 'spec', 'template', 'metadata', 'labels') || {};
      if (selects(termSelector(t, labels), otherLabels)) {
        errors.push([`${base}/requiredDuringSchedulingIgnoredDuringExecution/${i}`,
          `also selects the pods of StatefulSet ${get(other.obj, 'metadata', 'name')} (shard ${otherShard}): ` +
          `every ps pod would need a node of its own (${pods} nodes); select ${SHARD_LABEL}: "${shard}" too`]);
        break;
      }
    }
  });
  return errors;
}

// The worker Job, replayed under the Job controller's rules (job_rules.js):
// what deploy/k8s/README.md promises about failing workers.
function workerJobFailureErrors(spec) {
  const n = Number(spec.completions) || 1;
  const last = n - 1;
  const crash = (index, code = 1) => ({ index, exitCodes: { worker: code } });
  const evicted = (index) => ({ index, exitCodes: { worker: 143 }, conditions: ['DisruptionTarget'] });
  const scenarios = [
    ['one worker crashing once (exit 1)', [crash(last)], (r) => !r.failed,
      'must not fail the Job: the worker is retried and rejoins'],
    ['every worker crashing once', [...Array(n).keys()].map((i) => crash(i)), (r) => !r.failed,
      'must not fail the Job'],
    ['one worker crashing 10 times', Array(10).fill(crash(last)), (r) => !r.othersTerminated,
      'must leave the other workers training'],
    ['workers evicted or preempted 20 times (DisruptionTarget)', Array(20).fill(0).map((_, i) => evicted(i % n)),
      (r) => !r.failed, 'must not count against the Job'],
    ['a bad flag or cluster spec (exit 2)', [crash(0, 2)], (r) => r.failed && r.othersTerminated,
      'must fail the Job at once: every worker has the same configuration'],
  ];
  const problems = [];
  for (const [what, failures, ok, promise] of scenarios) {
    const r = jobOutcome(spec, failures);
    if (!ok(r)) {
      problems.push(`${what} ${promise}, but under the Job controller's rules ` +
        (r.failed ? `the Job fails (${r.reason})${r.othersTerminated ? ' and its running workers are terminated' : ''}`
          : 'the Job goes on'));
    }
  }
  return problems;
}

// ps_server checkpoints to CHECKPOINT_DIR, on one volume every shard mounts:
// a shard restores only when every shard's files are there.
function checkpointErrors(ps, data, findClaim) {
  const errors = [];
  const dir = data.CHECKPOINT_DIR;
  const podSpec = get(ps, 'spec', 'template', 'spec') || {};
  const container = (podSpec.containers || [])[0] || {};
  const command = [...(container.command || []), ...(container.args || [])].join(' ');
  if (!dir) errors.push(['/spec', 'pstrain-config has no CHECKPOINT_DIR: a restarted ps pod would come back empty']);
  if (!/--checkpoint_dir=/.test(command)) {
    errors.push(['/spec/template/spec/containers/0/args', 'ps_server runs without --checkpoint_dir: a restarted ps pod would come back empty']);
  }
  if (!dir) return errors;
  const mount = (container.volumeMounts || []).find((m) => m.mountPath === dir);
  if (!mount) {
    errors.push(['/spec/template/spec/containers/0/volumeMounts', `nothing is mounted at CHECKPOINT_DIR ${dir}`]);
    return errors;
  }
  if ((get(ps, 'spec', 'volumeClaimTemplates') || []).some((t) => get(t, 'metadata', 'name') === mount.name)) {
    errors.push(['/spec/volumeClaimTemplates', `checkpoint volume "${mount.name}" is per pod: a shard restores only when every shard's files are in CHECKPOINT_DIR; use one shared (ReadWriteMany) claim`]);
    return errors;
  }
  const volume = (podSpec.volumes || []).find((v) => v.name === mount.name) || {};
  const claimName = get(volume, 'persistentVolumeClaim', 'claimName');
  if (!claimName) {
    errors.push(['/spec/template/spec/volumes', `checkpoint volume "${mount.name}" is not a PersistentVolumeClaim: checkpoints would die with the pod`]);
    return errors;
  }
  const claim = findClaim(claimName);
  if (!claim) errors.push(['/spec/template/spec/volumes', `no PersistentVolumeClaim "${claimName}" in the set`]);
  else if (Number(get(ps, 'spec', 'replicas')) > 1 && !(get(claim.obj, 'spec', 'accessModes') || []).includes('ReadWriteMany')) {
    errors.push(['/spec/template/spec/volumes', `PersistentVolumeClaim "${claimName}" is shared by every shard: it needs accessModes ReadWriteMany`]);
  }
  return errors;
}

// --- Patches recorded from scale_workers.sh ---------------------------------------------

const KIND_ALIASES = {
  configmap: 'ConfigMap', configmaps: 'ConfigMap', cm: 'ConfigMap',
  job: 'Job', jobs: 'Job', 'job.batch': 'Job',
  statefulset: 'StatefulSet', statefulsets: 'StatefulSet', sts: 'StatefulSet',
  service: 'Service', svc: 'Service',
};

function mergePatch(target, patch) {  // RFC 7386
  if (patch === null || typeof patch !== 'object' || Array.isArray(patch)) return patch;
  const out = (target && typeof target === 'object' && !Array.isArray(target)) ? { ...target } : {};
  for (const [k, v] of Object.entries(patch)) {
    if (v === null) delete out[k];
    else out[k] = mergePatch(out[k], v);
  }
  return out;
}

function applyKubectlLog(logFile, docs) {
  const text = fs.readFileSync(logFile, 'utf8');
  const calls = [];
  let cur = [];
  for (const line of text.split('\n')) {
    if (line === '<<end>>') { calls.push(cur); cur = []; } else cur.push(line);
  }
  let applied = 0;
  for (const args of calls) {
    const i = args.indexOf('patch');
    if (i < 0) continue;
    let type = args[i + 1];
    let name = args[i + 2];
    if (type && type.includes('/')) [type, name] = type.split('/');
    const kind = KIND_ALIASES[String(type).toLowerCase()];
    let patchText = null;
    let patchType = 'strategic';
    for (let j = i + 1; j < args.length; j++) {
      const a = args[j];
      if ((a === '-p' || a === '--patch') && j + 1 < args.length) patchText = args[++j];
      else if (a.startsWith('--patch=')) patchText = a.slice(8);
      else if (a.startsWith('-p=')) patchText = a.slice(3);
      else if (a === '--type' && j + 1 < args.length) patchType = args[++j];
      else if (a.startsWith('--type=')) patchType = a.slice(7);
    }
    const where = `kubectl ${args.join(' ')}`;
    if (!kind) throw new Error(`${where}: unknown resource type "${type}"`);
    if (patchType !== 'merge') throw new Error(`${where}: only --type=merge patches are understood`);
    let patch;
    try {
      patch = JSON.parse(patchText);
    } catch (e) {
      throw new Error(`${where}: the patch is not JSON: ${e.message}`);
    }
    const doc = docs.find((d) => d.obj && d.obj.kind === kind && get(d.obj, 'metadata', 'name') === name);
    if (!doc) throw new Error(`${where}: no ${kind} "${name}" in the manifests`);
    doc.obj = mergePatch(doc.obj, patch);
    process.stdout.write(`patched ${kind}/${name}: ${JSON.stringify(patch)}\n`);
    applied++;
  }
  if (applied === 0) throw new Error(`${logFile}: no kubectl patch calls recorded`);
}

// --- Main ------------------------------------------------------------------------------

function validateSet(fileList) {
  const errors = [];  // {file, where, message}
  const docs = [];
  for (const f of fileList) docs.push(...loadDocs(f, errors));
  if (kubectlLog) {
    try {
      applyKubectlLog(kubectlLog, docs);
    } catch (e) {
      errors.push({ file: kubectlLog, where: kubectlLog, message: e.message });
    }
  }
  const counts = new Map();
  for (const doc of docs) {
    const before = errors.length;
    for (const e of [...schemaErrors(doc), ...unknownFieldErrors(doc)]) {
      errors.push({ file: doc.file, where: `${docLabel(doc)}: ${e.path || '/'}`, message: e.message });
    }
    counts.set(doc, errors.length - before);
  }
  for (const e of crossErrors(docs)) {
    errors.push({ file: e.doc.file, where: `${docLabel(e.doc)}: ${e.path || '/'}`, message: e.message });
    counts.set(e.doc, (counts.get(e.doc) || 0) + 1);
  }
  return { docs, errors, counts };
}

if (!expectInvalid) {
  const { docs, errors, counts } = validateSet(files);
  for (const doc of docs) {
    if (!counts.get(doc)) process.stdout.write(`ok   ${docLabel(doc)}\n`);
  }
  for (const e of errors) process.stdout.write(`FAIL ${e.where}: ${e.message}\n`);
  process.stdout.write(`${docs.length} document(s) in ${files.length} file(s), ${errors.length} error(s) ` +
                       `(kubernetes-models ${modelsVersion})\n`);
  process.exit(errors.length === 0 && docs.length > 0 ? 0 : 1);
} else {
  // Each file on its own: it must be rejected, with every "# expect:" text.
  let bad = 0;
  for (const f of files) {
    const { errors } = validateSet([f]);
    const expects = fs.readFileSync(f, 'utf8').split('\n')
      .map((l) => /^#\s*expect:\s*(.*\S)\s*$/.exec(l)).filter(Boolean).map((m) => m[1]);
    const lines = errors.map((e) => `${e.where}: ${e.message}`);
    for (const l of lines) process.stdout.write(`  rejected: ${l}\n`);
    if (errors.length === 0) {
      process.stdout.write(`FAIL ${f}: accepted, but it is invalid\n`);
      bad++;
      continue;
    }
    const missing = expects.filter((x) => !lines.some((l) => l.includes(x)));
    for (const x of missing) process.stdout.write(`FAIL ${f}: no error containing "${x}"\n`);
    if (missing.length) bad++;
    else process.stdout.write(`ok   ${path.basename(f)}: rejected (${errors.length} error(s), ${expects.length} expected text(s) found)\n`);
  }
  process.exit(bad === 0 ? 0 : 1);
}
