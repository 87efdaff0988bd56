package pgoutboxtest

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestDiscoverListsTheWays(t *testing.T) {
	_, err := discover([]string{"dsn"}, "postgres://postgres@127.0.0.1:1/postgres?sslmode=disable&connect_timeout=2")
	require.Error(t, err)
	require.Contains(t, err.Error(), "POSTGRES_DSN=postgres://postgres@127.0.0.1:1/")
	require.Contains(t, err.Error(), "Provide a PostgreSQL server for the tests in one of these ways:")
	require.Contains(t, err.Error(), "pgoutboxtest.StartServer")
	require.Contains(t, err.Error(), "SkipIfNoDatabase")

	_, err = discover([]string{"dsn", "docker"}, "")
	require.Error(t, err)
	require.Contains(t, err.Error(), "tried: POSTGRES_DSN: not set; docker: pgoutboxtest.StartServer is not set")
}
