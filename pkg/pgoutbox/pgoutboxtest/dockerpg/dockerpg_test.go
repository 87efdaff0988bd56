package dockerpg_test

import (
	"context"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest/dockerpg"
)

// TestMain tests the Docker way alone: no other server is tried.
func TestMain(m *testing.M) {
	os.Setenv("PGOUTBOX_PG_WAYS", "docker")
	dockerpg.Main(m)
}

// TestServerThroughPgoutboxtest: where a Docker engine answers, the tests
// get a Pub/Sub on PostgreSQL in a container; elsewhere the discovery error
// names the Docker engine missing and the ways to give one or a server.
func TestServerThroughPgoutboxtest(t *testing.T) {
	_, err := pgoutboxtest.ServerDSN()
	if !dockerAnswers() {
		require.Error(t, err)
		require.Contains(t, err.Error(), "docker: dockerpg: no Docker engine answers at ")
		require.Contains(t, err.Error(), "set DOCKER_HOST")
		require.Contains(t, err.Error(), "POSTGRES_DSN")

		_, err = dockerpg.StartServer(context.Background())
		require.ErrorIs(t, err, dockerpg.ErrNoDocker)
		return
	}
	require.NoError(t, err)
	env := pgoutboxtest.PubSub(t)
	msg := message.NewMessage(watermill.NewUUID(), []byte("in a container"))
	require.NoError(t, env.Publisher.Publish("t", msg))
	got := env.Drain(t, "t", 1, 30*time.Second)
	require.Equal(t, msg.UUID, got[0].UUID)

	// A second start returns the running server.
	dsn, err := dockerpg.StartServer(context.Background())
	require.NoError(t, err)
	server, err := pgoutboxtest.ServerDSN()
	require.NoError(t, err)
	require.Equal(t, server, dsn)
}

// dockerAnswers asks the engine for /_ping on its own, not through the
// code under test.
func dockerAnswers() bool {
	host := os.Getenv("DOCKER_HOST")
	if host == "" {
		host = "unix:///var/run/docker.sock"
	}
	network, addr, ok := strings.Cut(host, "://")
	if !ok || (network != "unix" && network != "tcp") {
		return false
	}
	client := &http.Client{Timeout: 3 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, network, addr)
		},
	}}
	resp, err := client.Get("http://docker/_ping")
	if err != nil {
		return false
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode == http.StatusOK && strings.TrimSpace(string(body)) == "OK"
}
