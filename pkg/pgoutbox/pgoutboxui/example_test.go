package pgoutboxui_test

import (
	"context"
	"net/http"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxui"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// requireOperator stands for the service's own authentication.
func requireOperator(h http.Handler) http.Handler { return h }

// Example mounts the operator page in a service under /outbox/, behind the
// service's authentication, with the write actions on, and gives its
// Observer to the service's subscriber for exact rates.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://app@db:5432/app")
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	tables := schema.Config{Schema: "app"}

	ui := pgoutboxui.Handler(tx.FromPgxPool(pool), tables, pgoutboxui.Options{BasePath: "/outbox/", Writes: true})
	defer ui.Close()
	mux := http.NewServeMux()
	mux.Handle("/outbox/", requireOperator(ui))

	sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{Tables: tables, ConsumerGroup: "billing", Observer: ui.Observer()}, nil)
	if err != nil {
		panic(err)
	}
	defer sub.Close()
	_ = http.ListenAndServe("127.0.0.1:8080", mux)
}
