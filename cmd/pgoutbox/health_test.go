package main

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
)

// health --json reports both tables and lists an open REPEATABLE READ
// transaction with its pid; stats prints the health lines below the
// queues, and health the holders' table.
func TestHealthCommand(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	publish(t, env, "orders", "a", "b")
	ctx := context.Background()
	holder, err := pgx.Connect(ctx, env.DSN)
	require.NoError(t, err)
	t.Cleanup(func() { _ = holder.Close(context.Background()) })
	_, err = holder.Exec(ctx, `BEGIN ISOLATION LEVEL REPEATABLE READ`)
	require.NoError(t, err)
	_, err = holder.Exec(ctx, `SELECT 1`)
	require.NoError(t, err)
	pid := int(holder.PgConn().PID())

	out, errOut, code := cliRun(t, env, "health", "--json")
	require.Equal(t, 0, code, errOut)
	var h healthJSON
	require.NoError(t, json.Unmarshal([]byte(out), &h), out)
	require.Equal(t, env.Schema+".outbox", h.Outbox.Table)
	require.NotNil(t, h.DeadLetters)
	require.Equal(t, env.Schema+".outbox_dlq", h.DeadLetters.Table)
	require.Positive(t, h.Outbox.TableBytes)
	var found *holderJSON
	for i, s := range h.SnapshotHolders {
		if s.Kind == "backend" && s.PID == pid {
			found = &h.SnapshotHolders[i]
		}
	}
	require.NotNil(t, found, out)
	require.Equal(t, "idle in transaction", found.State)
	require.NotNil(t, found.AgeSeconds)

	out, errOut, code = cliRun(t, env, "stats")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "orders")
	require.Contains(t, out, "\nTABLE ")
	require.Contains(t, out, env.Schema+".outbox ")
	require.Contains(t, out, "oldest snapshot: ")

	out, errOut, code = cliRun(t, env, "health")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "HOLDER ")
	require.Contains(t, out, "idle in transaction")

	_, errOut, code = cliRun(t, env, "health", "extra")
	require.Equal(t, exitUsage, code, errOut)
}

// health shows a rotating outbox's ring (read from the database, without
// --rotating), and nothing of the kind for a single table.
func TestHealthShowsTheRing(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSubWithOptions(t, pgoutboxtest.Options{Rotating: true})
	out, errOut, code := cliRun(t, env, "health", "--json")
	require.Equal(t, 0, code, errOut)
	var h healthJSON
	require.NoError(t, json.Unmarshal([]byte(out), &h), out)
	require.NotNil(t, h.Ring, out)
	require.Contains(t, []int{0, 1, 2}, h.Ring.Current)
	require.NotNil(t, h.Ring.CurrentForSeconds)
	out, errOut, code = cliRun(t, env, "health")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "ring: current partition ")

	single := pgoutboxtest.PubSub(t)
	out, errOut, code = cliRun(t, single, "health")
	require.Equal(t, 0, code, errOut)
	require.NotContains(t, out, "ring:")
}

// Behind an exclusive lock on the outbox (a VACUUM FULL, an ALTER TABLE, a
// migration), health answers and says the table is locked and how to find
// the session, and the commands that read the outbox give up after
// readTimeout with what to do, where they waited without a word for as
// long as the lock was held.
func TestCommandsBehindAnExclusiveLock(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	publish(t, env, "orders", "a")
	env.LockOutbox(t)

	out, errOut, code := cliRun(t, env, "health")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "locked")
	require.Contains(t, out, "is locked: a session holds or awaits an exclusive lock on it")
	require.Contains(t, out, "FROM pg_locks")

	start := time.Now()
	_, errOut, code = cliRun(t, env, "peek", "--topic", "orders")
	require.NotEqual(t, 0, code)
	require.Contains(t, errOut, "no answer within 15s: a session may hold or await an exclusive lock on the outbox")
	require.Less(t, time.Since(start), 25*time.Second)
}
