package main

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/pgoutbox/watermill-pgoutbox/internal/errtext"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxui"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

const uiExamples = `  pgoutbox ui                                    # read-only, http://127.0.0.1:8080/
  pgoutbox ui --listen 127.0.0.1:9000 --write    # requeue, delete, purge, pause, resume
  PGOUTBOX_UI_PASSWORD=s3cret pgoutbox ui --listen 0.0.0.0:8080 --basic-auth-user ops --write
  pgoutbox ui --base-path /outbox/               # behind a proxy that forwards /outbox/ as it is
`

// uiPasswordEnv holds the basic-auth password of "pgoutbox ui": never a
// flag, which other users could read in the process list.
const uiPasswordEnv = "PGOUTBOX_UI_PASSWORD"

func (c *cli) uiCmd(args []string) error {
	cmd := c.newCommand("ui", "ui [--listen 127.0.0.1:8080] [--write] [--basic-auth-user U] [--sample-interval 10s] [--base-path /]", uiExamples, false)
	listen := cmd.fs.String("listen", "127.0.0.1:8080", "address to serve on; localhost unless you give another")
	write := cmd.fs.Bool("write", false, "enable write actions (requeue, delete, purge, pause, resume); read-only without it")
	user := cmd.fs.String("basic-auth-user", "", "require HTTP basic auth as this user, with the password from $"+uiPasswordEnv)
	interval := cmd.durationVar("sample-interval", pgoutboxui.DefaultSampleInterval, "how often to take a Stats sample for the charts (a `duration`)")
	basePath := cmd.fs.String("base-path", "/", "the path the page is served under, starting and ending with a slash: behind a reverse proxy that forwards a prefix as it is (e.g. /outbox/), that prefix")
	if err := cmd.parseNoArgs(args); err != nil {
		return err
	}
	if *basePath == "" {
		*basePath = "/"
	}
	password := os.Getenv(uiPasswordEnv)
	switch {
	case *user != "" && password == "":
		return usagef(cmd.name, "--basic-auth-user needs a password in $%s", uiPasswordEnv)
	case *user == "" && password != "":
		return usagef(cmd.name, "$%s is set but --basic-auth-user is not; give the user name too", uiPasswordEnv)
	}
	host, _, err := net.SplitHostPort(*listen)
	if err != nil {
		return usagef(cmd.name, "--listen %q is not host:port (e.g. 127.0.0.1:8080)", *listen)
	}
	if ip := net.ParseIP(host); (ip == nil || !ip.IsLoopback()) && host != "localhost" && *user == "" {
		fmt.Fprintf(c.stderr, "pgoutbox: warning: serving on %s without --basic-auth-user: anyone who reaches it sees payloads%s\n",
			*listen, map[bool]string{true: " and can change data", false: ""}[*write])
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return cmd.withOutbox(ctx, nil, func(ctx context.Context, exec tx.Executor, tables schema.Config) error {
		ui, err := pgoutboxui.New(exec, tables, pgoutboxui.Options{Writes: *write, SampleInterval: *interval, BasePath: *basePath})
		if err != nil {
			if errors.Is(err, pgoutbox.ErrInvalidConfig) && cmd.given("base-path") {
				return usagef(cmd.name, "--base-path: %s", errtext.Trim(err))
			}
			return err
		}
		defer ui.Close()
		ui.Start() // the charts fill from now, not from the first page view
		var h http.Handler = ui
		if *user != "" {
			h = basicAuth(*user, password, ui)
		}
		ln, err := net.Listen("tcp", *listen)
		if err != nil {
			return fmt.Errorf("listen on %s: %w; choose another --listen", *listen, err)
		}
		srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
		mode := "read-only"
		if *write {
			mode = "writes enabled"
		}
		fmt.Fprintf(c.stdout, "pgoutbox ui on %s (%s); Ctrl-C to stop\n", browsable(ln.Addr(), *basePath), mode)
		errc := make(chan error, 1)
		go func() { errc <- srv.Serve(ln) }()
		select {
		case err := <-errc:
			return fmt.Errorf("serve: %w", err)
		case <-ctx.Done():
		}
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := srv.Shutdown(sctx); err != nil && !errors.Is(err, context.DeadlineExceeded) {
			return fmt.Errorf("shut down: %w", err)
		}
		return nil
	})
}

// basicAuth requires user and password, compared in constant time.
func basicAuth(user, password string, next http.Handler) http.Handler {
	wantU, wantP := sha256.Sum256([]byte(user)), sha256.Sum256([]byte(password))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		u, p, ok := r.BasicAuth()
		gotU, gotP := sha256.Sum256([]byte(u)), sha256.Sum256([]byte(p))
		if !ok || subtle.ConstantTimeCompare(gotU[:], wantU[:])&subtle.ConstantTimeCompare(gotP[:], wantP[:]) != 1 {
			w.Header().Set("WWW-Authenticate", `Basic realm="pgoutbox", charset="UTF-8"`)
			http.Error(w, "authentication required", http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r)
	})
}

// browsable is the page's address as a browser reaches it: a listener on
// every interface (0.0.0.0, ::, an empty host) would print as
// [::]:port, which no browser opens; it says localhost, and that every
// interface listens.
func browsable(addr net.Addr, basePath string) string {
	tcp, ok := addr.(*net.TCPAddr)
	if !ok || !tcp.IP.IsUnspecified() {
		return "http://" + addr.String() + basePath
	}
	return fmt.Sprintf("http://localhost:%d%s (every interface)", tcp.Port, basePath)
}
