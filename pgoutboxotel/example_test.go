package pgoutboxotel_test

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/pgoutbox/watermill-pgoutbox/pgoutboxotel"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// Example follows one trace from a request's span to the handler: the
// publisher writes the request's trace context into the message, in the
// request's transaction, and the Router's handler runs in a span of the
// same trace, whose parent is the request's span. (It needs PostgreSQL:
// POSTGRES_DSN, or the local default.)
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
	tables := schema.Config{Schema: "pgoutboxotel_example_" + watermill.NewUUID()[:8]}
	if err := schema.Create(ctx, tx.FromPgxPool(pool), tables); err != nil {
		panic(err)
	}
	defer pool.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{tables.Schema}.Sanitize()+" CASCADE") //nolint:errcheck

	spans := tracetest.NewInMemoryExporter() // an OTLP exporter in a service
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(spans))
	tracing := pgoutboxotel.NewTracing(pgoutboxotel.TracingOptions{TracerProvider: tp})
	logger := watermill.NopLogger{}

	// The consumer: the tracing middleware first.
	sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{Tables: tables}, logger)
	if err != nil {
		panic(err)
	}
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		panic(err)
	}
	router.AddMiddleware(tracing.Middleware, pgoutbox.ErrorRecorder)
	done := make(chan struct{})
	router.AddConsumerHandler("ship_order", "orders.placed", sub, func(msg *message.Message) error {
		close(done)
		return nil
	})
	go router.Run(ctx) //nolint:errcheck
	defer router.Close()
	<-router.Running()

	// The request: its span, its transaction, its message.
	reqCtx, reqSpan := tp.Tracer("http").Start(ctx, "POST /orders")
	pgTx, err := pool.Begin(reqCtx)
	if err != nil {
		panic(err)
	}
	pub, err := pgoutbox.NewPublisher(tx.FromPgxTx(pgTx), pgoutbox.PublisherConfig{Tables: tables, PublishHook: tracing}, logger)
	if err != nil {
		panic(err)
	}
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order":42}`))
	msg.SetContext(reqCtx) // the trace context it carries
	if err := pub.Publish("orders.placed", msg); err != nil {
		panic(err)
	}
	if err := pgTx.Commit(reqCtx); err != nil {
		panic(err)
	}
	reqSpan.End()

	<-done
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		for _, s := range spans.GetSpans() {
			if s.Name == "process orders.placed" {
				fmt.Println("same trace:", s.SpanContext.TraceID() == reqSpan.SpanContext().TraceID())
				fmt.Println("parent is the request's span:", s.Parent.SpanID() == reqSpan.SpanContext().SpanID())
				return
			}
		}
	}
	fmt.Println("no handler span")
	// Output:
	// same trace: true
	// parent is the request's span: true
}
