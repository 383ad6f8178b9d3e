#!/usr/bin/env bash
# A --master-port that another process holds is a clear error (exit 2).
# Usage: port_in_use.sh COMPOSER
set -u
composer=$1
exec /usr/bin/python3 - "$composer" "$(dirname "$0")/expect.sh" <<'PY'
import socket, subprocess, sys
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen()
port = s.getsockname()[1]
r = subprocess.run([sys.argv[2], "2", f"cannot host the rendezvous on 127.0.0.1:{port}.*choose another --master-port",
                    sys.argv[1], "run", "--config", "configs/parity/replicate_mlp_module_dp2.yaml",
                    "--master-port", str(port), "--out", "/tmp/composer_port_in_use"], timeout=60)
sys.exit(r.returncode)
PY
