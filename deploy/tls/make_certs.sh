#!/usr/bin/env bash
# Makes a private CA and the certificates a pstrain job needs for TLS and
# mutual TLS, with the openssl command-line tool (Debian package openssl).
#
#   deploy/tls/make_certs.sh DIR [NAME...]
#
# NAMEs are the host names and IP addresses the servers are reached by; each
# becomes a subjectAltName of the server certificate (default: localhost
# 127.0.0.1). For Kubernetes list the shards' DNS names, e.g.
#   deploy/tls/make_certs.sh tls ps-0.ps ps-1.ps '*.ps.pstrain.svc.cluster.local'
#
# Writes into DIR (created if needed; existing files are replaced):
#   ca.pem ca.key             the CA (keep ca.key private, or delete it)
#   server.pem server.key     ps_server: --tls_cert, --tls_key (good for client
#                             auth too: replicas of a shard call each other)
#   client.pem client.key     worker (mutual TLS): --tls_cert, --tls_key
# and both sides trust ca.pem (ps_server --tls_client_ca, worker --tls_ca).
# Keys are ECDSA P-256, certificates valid for DAYS days (default 365).
#
# Exit status: 0 done, 1 openssl failed, 2 bad usage.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }
if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
  usage
  [[ $# -ge 1 ]] && exit 0
  exit 2
fi
command -v openssl >/dev/null || { echo "make_certs.sh: openssl not found (apt-get install openssl)" >&2; exit 1; }
dir=$1
shift
names=("$@")
((${#names[@]} > 0)) || names=(localhost 127.0.0.1)
days=${DAYS:-365}
[[ $days =~ ^[1-9][0-9]*$ ]] || { echo "make_certs.sh: DAYS must be a positive integer" >&2; exit 2; }

mkdir -p -- "$dir"
umask 077
san=""
for name in "${names[@]}"; do
  if [[ $name =~ ^[0-9.]+$ || $name == *:* ]]; then
    san+="${san:+,}IP:$name"
  else
    san+="${san:+,}DNS:$name"
  fi
done

key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

key "$dir/ca.key"
openssl req -x509 -new -key "$dir/ca.key" -days "$days" -subj "/CN=pstrain test CA" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
  -out "$dir/ca.pem"

# sign NAME CN EXTENSIONS...: NAME.key, NAME.pem signed by the CA.
sign() {
  local name=$1 cn=$2 ext=$3
  key "$dir/$name.key"
  openssl req -new -key "$dir/$name.key" -subj "/CN=$cn" -out "$dir/$name.csr"
  printf '%s\n' "$ext" >"$dir/$name.ext"
  openssl x509 -req -in "$dir/$name.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" \
    -CAcreateserial -days "$days" -extfile "$dir/$name.ext" -out "$dir/$name.pem" 2>/dev/null
  rm -f -- "$dir/$name.csr" "$dir/$name.ext"
}
sign server "${names[0]}" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth,clientAuth
subjectAltName=$san"
sign client "pstrain worker" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
rm -f -- "$dir/ca.srl"
chmod 644 "$dir"/*.pem
echo "make_certs.sh: wrote ca, server ($san) and client certificates to $dir" >&2
