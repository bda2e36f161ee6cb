# Sourced by the bench scripts: `nginx_conf DIR NAME HTTP` writes DIR/NAME.conf, a foreground
# nginx with one worker, its pid and error log in DIR (DIR/NAME.pid, DIR/NAME-error.log), no
# access log, and HTTP as the body of its `http` block.
nginx_conf() {
  mkdir -p "$1/$2-tmp"
  cat > "$1/$2.conf" <<CONF
worker_processes 1;
daemon off;
pid $1/$2.pid;
error_log $1/$2-error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $1/$2-tmp;
$3
}
CONF
}
