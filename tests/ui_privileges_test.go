package tests

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxui"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// The operator page, read-only, works with the README's least-privilege
// subscriber role: every page answers 200, the sampler's statements
// included.
func TestUIWithSubscriberRole(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	subPool := b.loginRole(t, "uisub",
		`GRANT USAGE ON SCHEMA %s TO %r`,
		`GRANT SELECT, UPDATE, DELETE ON %s.outbox TO %r`,
		`GRANT SELECT, INSERT ON %s.outbox_bindings TO %r`,
		`GRANT SELECT, INSERT ON %s.outbox_dlq TO %r`,
		`GRANT SELECT ON %s.outbox_paused TO %r`)
	require.NoError(t, pgoutbox.Bind(ctx, tx.FromPgxPool(b.Pool), b.tables, "orders", "billing"))
	require.NoError(t, b.poolPublisher(t).Publish("orders", newMsg("x")))
	require.NoError(t, pgoutbox.PauseGroup(ctx, tx.FromPgxPool(b.Pool), b.tables, "orders", "billing"))
	_, err := b.Pool.Exec(ctx, `INSERT INTO `+b.Schema+`.outbox_dlq (id, topic, consumer_group, uuid, payload, metadata, created_at, deliveries, failure_reason)
VALUES (9001, 'orders', 'billing', 'u', 'p', '{}', now(), 3, 'rejected')`)
	require.NoError(t, err)

	ui, err := pgoutboxui.New(tx.FromPgxPool(subPool), b.tables, pgoutboxui.Options{SampleInterval: 100 * time.Millisecond})
	require.NoError(t, err)
	defer ui.Close()
	srv := httptest.NewServer(ui)
	defer srv.Close()
	for _, p := range []string{"", "group?topic=orders&group=billing", "dead-letters", "dead-letters?topic=orders", "dead-letter?id=9001"} {
		resp, err := http.Get(srv.URL + "/" + p)
		require.NoError(t, err)
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode, "%s: %s", p, body)
		require.NotContains(t, string(body), "Last sample failed", p)
		require.NotContains(t, string(body), "permission denied", p)
	}
}

// Each write action of the operator page, run by what it calls, with the
// subscriber role and exactly the grants docs/ui.md adds for it.
func TestUIWriteActionsWithTheDocumentedGrants(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	subscriber := []string{
		`GRANT USAGE ON SCHEMA %s TO %r`,
		`GRANT SELECT, UPDATE, DELETE ON %s.outbox TO %r`,
		`GRANT SELECT, INSERT ON %s.outbox_bindings TO %r`,
		`GRANT SELECT, INSERT ON %s.outbox_dlq TO %r`,
		`GRANT SELECT ON %s.outbox_paused TO %r`,
	}
	letter := func(id int64) {
		_, err := b.Pool.Exec(ctx, `INSERT INTO `+b.Schema+`.outbox_dlq (id, topic, consumer_group, uuid, payload, metadata, created_at, failed_at, deliveries, failure_reason)
VALUES ($1, 'orders', '', gen_random_uuid()::text, 'p', '{}', now(), now() - interval '2 days', 3, 'rejected')`, id)
		require.NoError(t, err)
	}
	for name, tc := range map[string]struct {
		grants []string
		act    func(tx.Executor) error
	}{
		"requeue": {
			grants: []string{`GRANT INSERT ON %s.outbox TO %r`, `GRANT UPDATE, DELETE ON %s.outbox_dlq TO %r`},
			act: func(e tx.Executor) error {
				letter(9101)
				n, err := pgoutbox.RequeueDeadLetters(ctx, e, b.tables, []int64{9101})
				if err == nil && n != 1 {
					err = fmt.Errorf("requeued %d letters, want 1", n)
				}
				return err
			},
		},
		"delete": {
			grants: []string{`GRANT DELETE ON %s.outbox_dlq TO %r`},
			act: func(e tx.Executor) error {
				letter(9102)
				_, err := pgoutbox.DeleteDeadLetters(ctx, e, b.tables, []int64{9102})
				return err
			},
		},
		"purge": {
			grants: []string{`GRANT DELETE ON %s.outbox_dlq TO %r`},
			act: func(e tx.Executor) error {
				letter(9103)
				_, err := pgoutbox.PurgeDeadLetters(ctx, e, b.tables, 24*time.Hour, 0)
				return err
			},
		},
		"pause and resume": {
			grants: []string{`GRANT INSERT, DELETE ON %s.outbox_paused TO %r`},
			act: func(e tx.Executor) error {
				if err := pgoutbox.PauseGroup(ctx, e, b.tables, "orders", ""); err != nil {
					return err
				}
				_, err := pgoutbox.ResumeGroup(ctx, e, b.tables, "orders", "")
				return err
			},
		},
	} {
		pool := b.loginRole(t, "uiop", append(append([]string{}, subscriber...), tc.grants...)...)
		require.NoError(t, tc.act(tx.FromPgxPool(pool)), name)
	}
}
