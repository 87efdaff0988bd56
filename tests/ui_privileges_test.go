package tests

import (
	"context"
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
