package pgoutbox_test

import (
	"context"
	"fmt"
	"time"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// Example_health checks what a queue table needs from vacuum: how many
// dead rows it carries, and whether something has held back their removal
// for too long (and who, to end it).
func Example_health() {
	ctx := context.Background()
	pool, tables, drop := exampleOutbox("health")
	defer drop()

	h, err := pgoutbox.Health(ctx, tx.FromPgxPool(pool), tables)
	if err != nil {
		panic(err)
	}
	// Also there: h.Outbox.TableBytes, IndexBytes, LastAutovacuum, and h.DeadLetters.
	fmt.Printf("dead tuples: %d (%.0f%%)\n", h.Outbox.DeadTuples, 100*h.Outbox.DeadFraction())
	if s, ok := h.OldestSnapshot(); ok && (s.Age > 15*time.Minute || s.XminAge > 10_000_000) {
		// A session: SELECT pg_terminate_backend(s.PID); a slot: pg_drop_replication_slot(s.Name).
		fmt.Printf("vacuum held back for %s (%d transactions) by %s pid=%d user=%s application=%q state=%q slot/gid=%q\n",
			s.Age, s.XminAge, s.Kind, s.PID, s.User, s.ApplicationName, s.State, s.Name)
	}
	// Output:
	// dead tuples: 0 (0%)
}
