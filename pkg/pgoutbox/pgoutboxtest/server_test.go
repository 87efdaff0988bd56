package pgoutboxtest

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
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

func TestTestDatabaseDSNUsesTheNamedDatabase(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ dsn, named string }{
		{"postgres://u@h:5432/myapp_test?sslmode=disable", "myapp_test"},
		{"postgresql://u@h/app", "app"},
		{"postgres://u@h:5432?sslmode=disable", ""},
		{"postgres://u@h:5432/", ""},
		{"host=h user=u dbname=kv_test", "kv_test"},
		{"host=h user=u", ""},
	} {
		require.Equal(t, c.named, namedDatabase(c.dsn), c.dsn)
	}
	dsn, err := withDatabase("postgres://u@h:5432/postgres?sslmode=disable", Database)
	require.NoError(t, err)
	require.Equal(t, "postgres://u@h:5432/pgoutbox_test?sslmode=disable", dsn)
	dsn, err = withDatabase("host=h user=u", Database)
	require.NoError(t, err)
	require.Equal(t, Database, namedDatabase(dsn))

	// Against the server: a named database is used as it is, the
	// maintenance database means Database.
	server, err := ServerDSN()
	if err != nil {
		t.Skipf("no server: %v", err)
	}
	forServer, err := withDatabase(server, "postgres")
	require.NoError(t, err)
	got, err := testDatabaseDSN(forServer)
	require.NoError(t, err)
	require.Equal(t, Database, namedDatabase(got))

	named, err := withDatabase(server, "pgoutboxtest_named")
	require.NoError(t, err)
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, forServer)
	require.NoError(t, err)
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, `CREATE DATABASE pgoutboxtest_named`); err != nil {
		require.Contains(t, err.Error(), "already exists")
	}
	got, err = testDatabaseDSN(named)
	require.NoError(t, err)
	require.Equal(t, named, got)

	// A schema made through Options.DSN=that DSN lands in that database.
	s := NewSchema(t, Options{DSN: got})
	var db string
	require.NoError(t, s.Pool.QueryRow(ctx, `SELECT current_database()`).Scan(&db))
	require.Equal(t, "pgoutboxtest_named", db)
}
