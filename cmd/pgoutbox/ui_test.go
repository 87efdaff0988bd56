package main

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/http"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
)

func TestUIUsage(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	_, errOut, code := cliRun(t, env, "ui", "--basic-auth-user", "ops")
	require.Equal(t, exitUsage, code)
	require.Contains(t, errOut, "PGOUTBOX_UI_PASSWORD")
	_, errOut, code = cliRun(t, env, "ui", "--listen", "8080")
	require.Equal(t, exitUsage, code)
	require.Contains(t, errOut, "host:port")
	_, errOut, code = cliRun(t, env, "ui", "--base-path", "outbox")
	require.Equal(t, exitUsage, code, errOut)
	require.Contains(t, errOut, "--base-path: ")
	require.Contains(t, errOut, "must start and end with a slash")
}

// pgoutbox ui serves the page on the address it prints, under its
// --base-path (behind a proxy that forwards a prefix), behind basic auth
// when asked, and stops on SIGINT.
func TestUIServes(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	publish(t, env, "orders", "a")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, binary, "ui", "--listen", "127.0.0.1:0", "--basic-auth-user", "ops", "--base-path", "/outbox/", "--dsn", env.DSN, "--schema", env.Schema)
	cmd.Env = append(cliEnv(), "PGOUTBOX_UI_PASSWORD=s3cret")
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	line, err := bufio.NewReader(stdout).ReadString('\n')
	require.NoError(t, err)
	require.Contains(t, line, "read-only")
	url := strings.Fields(strings.SplitN(line, " on ", 2)[1])[0]
	require.True(t, strings.HasPrefix(url, "http://127.0.0.1:"), line)
	require.True(t, strings.HasSuffix(url, "/outbox/"), line)

	resp, err := http.Get(url)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusUnauthorized, resp.StatusCode)
	req, err := http.NewRequest(http.MethodGet, url, nil)
	require.NoError(t, err)
	req.SetBasicAuth("ops", "s3cret")
	resp, err = http.DefaultClient.Do(req)
	require.NoError(t, err)
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Contains(t, string(body), `data-topic="orders"`)
	require.Contains(t, string(body), `href="/outbox/dead-letters"`, "links stay under the base path")

	require.NoError(t, cmd.Process.Signal(syscall.SIGINT))
	require.NoError(t, cmd.Wait(), "exits 0 on Ctrl-C")
}

// A listener on every interface prints an address a browser opens.
func TestBrowsableAddress(t *testing.T) {
	for _, c := range []struct {
		addr net.Addr
		want string
	}{
		{&net.TCPAddr{IP: net.IPv6unspecified, Port: 8080}, "http://localhost:8080/ (every interface)"},
		{&net.TCPAddr{IP: net.IPv4zero, Port: 8080}, "http://localhost:8080/ (every interface)"},
		{&net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 8080}, "http://127.0.0.1:8080/"},
	} {
		require.Equal(t, c.want, browsable(c.addr, "/"))
	}
}
