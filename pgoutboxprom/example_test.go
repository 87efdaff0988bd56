package pgoutboxprom_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/components/metrics"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/pgoutbox/watermill-pgoutbox/pgoutboxprom"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// Example wires pgoutbox's metrics next to Watermill's own: the Router's
// handler metrics from components/metrics, the outbox's state from a
// Collector (read on each scrape), and the publisher's and subscriber's
// events from an Observer, all on one registry served at /metrics. (It
// needs PostgreSQL: POSTGRES_DSN, or the local default.)
func Example() {
	ctx := context.Background()
	dsn := os.Getenv("POSTGRES_DSN")
	if dsn == "" {
		dsn = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
	}
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	tables := schema.Config{Schema: "pgoutboxprom_example_" + watermill.NewUUID()[:8]}
	if err := schema.Create(ctx, tx.FromPgxPool(pool), tables); err != nil {
		panic(err)
	}
	defer pool.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{tables.Schema}.Sanitize()+" CASCADE") //nolint:errcheck

	logger := watermill.NopLogger{}
	reg := prometheus.NewRegistry()

	// pgoutbox: the outbox's state, and the events the Router cannot see.
	reg.MustRegister(pgoutboxprom.NewCollector(tx.FromPgxPool(pool), tables, pgoutboxprom.Options{}))
	observer, err := pgoutboxprom.NewObserver(reg, pgoutboxprom.Options{})
	if err != nil {
		panic(err)
	}

	pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(pool), pgoutbox.PublisherConfig{Tables: tables, Observer: observer}, logger)
	if err != nil {
		panic(err)
	}
	sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{Tables: tables, Observer: observer}, logger)
	if err != nil {
		panic(err)
	}

	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		panic(err)
	}
	// Watermill: handler durations, messages received and published.
	metrics.NewPrometheusMetricsBuilder(reg, "myapp", "pubsub").AddPrometheusRouterMetrics(router)
	router.AddConsumerHandler("ship_order", "orders", sub, func(msg *message.Message) error { return nil })
	go func() { _ = router.Run(ctx) }()
	<-router.Running()
	defer router.Close()

	for i := range 2 {
		if err := pub.Publish("orders", message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, "order %d", i))); err != nil {
			panic(err)
		}
	}

	// In production: http.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{})).
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	defer srv.Close()
	scrape := func() string {
		resp, err := http.Get(srv.URL)
		if err != nil {
			panic(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return string(body)
	}
	acked := `pgoutbox_subscriber_messages_acked_total{consumer_group="",topic="orders"} 2`
	body := scrape()
	for deadline := time.Now().Add(10 * time.Second); !strings.Contains(body, acked) && time.Now().Before(deadline); body = scrape() {
		time.Sleep(20 * time.Millisecond)
	}
	for _, line := range strings.Split(body, "\n") {
		switch {
		case strings.HasPrefix(line, "pgoutbox_publisher_messages_published_total"),
			strings.HasPrefix(line, "pgoutbox_subscriber_messages_acked_total"),
			strings.HasPrefix(line, `pgoutbox_messages{consumer_group="",state="ready"`),
			strings.HasPrefix(line, `myapp_pubsub_handler_execution_time_seconds_count{handler_name="ship_order",success="true"}`):
			fmt.Println(line)
		}
	}
	// Output:
	// myapp_pubsub_handler_execution_time_seconds_count{handler_name="ship_order",success="true"} 2
	// pgoutbox_messages{consumer_group="",state="ready",topic="orders"} 0
	// pgoutbox_publisher_messages_published_total{topic="orders"} 2
	// pgoutbox_subscriber_messages_acked_total{consumer_group="",topic="orders"} 2
}
