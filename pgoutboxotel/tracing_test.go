package pgoutboxotel_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/pgoutbox/watermill-pgoutbox/pgoutboxotel"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/relay"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// runUnderSpan runs router under a context that holds a span of its own
// (an application's "startup"), until the test ends: a message without
// trace context must not join that span.
func runUnderSpan(t *testing.T, tp *sdktrace.TracerProvider, router *message.Router) {
	startCtx, startup := tp.Tracer("app").Start(context.Background(), "startup")
	runCtx, stop := context.WithCancel(startCtx)
	t.Cleanup(func() { stop(); startup.End() })
	go func() { _ = router.Run(runCtx) }()
	<-router.Running()
}

// newTracing is a Tracing whose spans go to the in-memory exporter it
// returns, and its provider (shut down when the test ends).
func newTracing(t *testing.T) (*tracetest.InMemoryExporter, *sdktrace.TracerProvider, *pgoutboxotel.Tracing) {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return exp, tp, pgoutboxotel.NewTracing(pgoutboxotel.TracingOptions{TracerProvider: tp})
}

// spans returns the ended spans named name, waiting until there are n.
func spans(t *testing.T, exp *tracetest.InMemoryExporter, name string, n int) []tracetest.SpanStub {
	t.Helper()
	var got []tracetest.SpanStub
	require.Eventually(t, func() bool {
		got = got[:0]
		for _, s := range exp.GetSpans() {
			if s.Name == name {
				got = append(got, s)
			}
		}
		return len(got) >= n
	}, 20*time.Second, 5*time.Millisecond, "%d spans named %q", n, name)
	require.Len(t, got, n, "spans named %q", name)
	return got
}

func attrsOf(s tracetest.SpanStub) map[attribute.Key]attribute.Value {
	m := map[attribute.Key]attribute.Value{}
	for _, a := range s.Attributes {
		m[a.Key] = a.Value
	}
	return m
}

// requireChildOf fails unless s is in parent's trace with parent as its
// parent span.
func requireChildOf(t *testing.T, s tracetest.SpanStub, parent trace.SpanContext) {
	t.Helper()
	require.Equal(t, parent.TraceID(), s.SpanContext.TraceID(), "%s is in another trace", s.Name)
	require.Equal(t, parent.SpanID(), s.Parent.SpanID(), "%s has another parent", s.Name)
	require.True(t, s.Parent.IsRemote(), "%s's parent came through the metadata", s.Name)
}

// One trace from a request to the end of the chain: a span started like an
// HTTP handler's publishes a message in its transaction; a Router handler
// fails its first delivery and succeeds on the retry, both in consumer
// spans that are children of the request's span, with the messaging
// attributes; its output (published by the Router) is handled under
// tx.Middleware, whose own output (published in the handler's transaction)
// is relayed to a GoChannel and handled there: each handler's span is the
// child of the one before. The request's baggage reaches every handler.
func TestOneTraceFromTheRequestThroughRetryTxMiddlewareAndRelay(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := pgoutboxtest.PubSub(t)
	exp, tp, tracing := newTracing(t)
	pubCfg := pgoutbox.PublisherConfig{Tables: env.Tables, PublishHook: tracing}
	logger := watermill.NopLogger{}

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	require.NoError(t, err)
	router.AddMiddleware(tracing.Middleware, pgoutbox.ErrorRecorder)
	sub := func(group string) *pgoutbox.Subscriber {
		return env.NewSubscriber(t, func(c *pgoutbox.SubscriberConfig) {
			c.ConsumerGroup = group
			c.RetryPolicy = pgoutbox.ConstantBackoff{Delay: 0, MaxAttempts: -1}
		})
	}
	poolPub, err := pgoutbox.NewPublisher(tx.FromPgxPool(env.Pool), pubCfg, logger)
	require.NoError(t, err)
	ctxPub, err := pgoutbox.NewContextPublisher(tx.FromPgxPool(env.Pool), pubCfg, logger)
	require.NoError(t, err)
	txmw, err := tx.Middleware(tx.FromPgxPool(env.Pool), tx.MiddlewareConfig{Publisher: ctxPub})
	require.NoError(t, err)

	var shipCalls atomic.Int32
	var baggageSeen sync.Map // handler -> the request's baggage member
	seeBaggage := func(handler string, msg *message.Message) {
		baggageSeen.Store(handler, baggage.FromContext(msg.Context()).Member("customer").Value())
	}
	router.AddHandler("ship", "orders", sub("shipping"), "shipped", poolPub, func(msg *message.Message) ([]*message.Message, error) {
		seeBaggage("ship", msg)
		if shipCalls.Add(1) == 1 {
			return nil, errors.New("carrier unavailable")
		}
		return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("shipped"))}, nil
	})
	router.AddHandler("bill", "shipped", sub("billing"), "billed", ctxPub, func(msg *message.Message) ([]*message.Message, error) {
		seeBaggage("bill", msg)
		if _, ok := tx.PgxTxFromContext(msg.Context()); !ok {
			return nil, errors.New("no transaction in the handler's context")
		}
		// Two outputs: both carry the handler's span, not only the
		// first, whose context the publish runs with.
		return []*message.Message{
			message.NewMessage(watermill.NewUUID(), []byte("billed")),
			message.NewMessage(watermill.NewUUID(), []byte("billed too")),
		}, nil
	}).AddMiddleware(txmw)

	// The relay moves "billed" to a GoChannel, consumed by a handler of its
	// own (what a NATS or RabbitMQ consumer reading the W3C metadata does).
	broker := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16, Persistent: true}, logger)
	r, err := relay.New(env.Pool, broker, relay.Config{
		Topics:     []string{"billed"},
		Subscriber: pgoutbox.SubscriberConfig{Tables: env.Tables, ConsumerGroup: "relay", MinPollInterval: 10 * time.Millisecond, MaxPollInterval: 500 * time.Millisecond},
	})
	require.NoError(t, err)
	router.AddConsumerHandler("notify", "billed", broker, func(msg *message.Message) error {
		seeBaggage("notify", msg)
		return nil
	})
	// Bind every group before anything is published: a topic without a
	// binding keeps its messages for the default group only.
	for topic, group := range map[string]string{"orders": "shipping", "shipped": "billing", "billed": "relay"} {
		require.NoError(t, pgoutbox.Bind(ctx, tx.FromPgxPool(env.Pool), env.Tables, topic, group))
	}

	runCtx, stop := context.WithCancel(ctx)
	go func() { _ = router.Run(runCtx) }()
	go func() { _ = r.Run(runCtx) }()
	t.Cleanup(func() {
		stop()
		<-router.Running() // closed once started; Close waits for the handlers
		_ = router.Close()
		_ = r.Close()
	})
	<-router.Running()

	// The request: an HTTP handler that starts a server span (reading the
	// caller's baggage from the headers, as HTTP instrumentation does),
	// begins its transaction with the span's context and publishes a
	// message built with that context.
	type published struct {
		request trace.SpanContext
		order   *message.Message
	}
	handled := make(chan published, 1) // the race detector sees no order through a socket
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		in := propagation.Baggage{}.Extract(r.Context(), propagation.HeaderCarrier(r.Header))
		reqCtx, reqSpan := tp.Tracer("http").Start(in, r.Method+" "+r.URL.Path, trace.WithSpanKind(trace.SpanKindServer))
		defer reqSpan.End()
		var order *message.Message
		err := func() error {
			pgTx, err := env.Pool.Begin(reqCtx)
			if err != nil {
				return err
			}
			defer pgTx.Rollback(reqCtx) //nolint:errcheck // after Commit, a no-op
			pub, err := pgoutbox.NewPublisher(tx.FromPgxTx(pgTx), pubCfg, logger)
			if err != nil {
				return err
			}
			order = message.NewMessage(watermill.NewUUID(), []byte("order"))
			order.SetContext(reqCtx)
			if err := pub.Publish("orders", order); err != nil {
				return err
			}
			return pgTx.Commit(reqCtx)
		}()
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		handled <- published{reqSpan.SpanContext(), order}
		w.WriteHeader(http.StatusAccepted)
	}))
	t.Cleanup(srv.Close)
	req, err := http.NewRequest(http.MethodPost, srv.URL+"/orders", nil)
	require.NoError(t, err)
	req.Header.Set("baggage", "customer=42")
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	require.Equal(t, http.StatusAccepted, resp.StatusCode)
	p := <-handled
	request, order := p.request, p.order
	require.True(t, request.IsValid())
	require.NotEmpty(t, order.Metadata.Get("traceparent"), "the W3C trace context is in the metadata")

	ship := spans(t, exp, "process orders", 2)
	for i, s := range ship {
		requireChildOf(t, s, request)
		require.Equal(t, trace.SpanKindConsumer, s.SpanKind)
		a := attrsOf(s)
		require.Equal(t, "pgoutbox", a["messaging.system"].AsString())
		require.Equal(t, "orders", a["messaging.destination.name"].AsString())
		require.Equal(t, "process", a["messaging.operation.type"].AsString())
		require.Equal(t, "process", a["messaging.operation.name"].AsString())
		require.Equal(t, order.UUID, a["messaging.message.id"].AsString())
		require.Equal(t, "shipping", a["messaging.consumer.group.name"].AsString())
		require.EqualValues(t, 5, a["messaging.message.body.size"].AsInt64())
		require.EqualValues(t, i+1, a[pgoutboxotel.DeliveryAttemptKey].AsInt64(), "the retry is the second delivery, in the same trace")
		require.Contains(t, []string{pgoutbox.PathHeld, pgoutbox.PathLease}, a[pgoutboxotel.ClaimPathKey].AsString())
	}
	require.Equal(t, codes.Error, ship[0].Status.Code, "the failed delivery's span says so")
	require.Equal(t, "carrier unavailable", ship[0].Status.Description)
	require.NotEmpty(t, ship[0].Events, "the error is recorded")
	require.Equal(t, codes.Unset, ship[1].Status.Code)

	bill := spans(t, exp, "process shipped", 1)[0]
	requireChildOf(t, bill, ship[1].SpanContext)
	require.Equal(t, "billing", attrsOf(bill)["messaging.consumer.group.name"].AsString())

	notify := spans(t, exp, "process billed", 2)
	for _, s := range notify {
		requireChildOf(t, s, bill.SpanContext)
		_, delivered := attrsOf(s)[pgoutboxotel.DeliveryAttemptKey]
		require.False(t, delivered, "a message the broker delivered has no pgoutbox delivery")
	}
	for _, h := range []string{"ship", "bill", "notify"} {
		v, ok := baggageSeen.Load(h)
		require.True(t, ok, h)
		require.Equal(t, "42", v, "the request's baggage in handler %s", h)
	}
}

// A message published without a span, and one whose trace metadata does
// not parse, are handled in spans of new traces (no parent), and acked,
// also under a Router run with a span in its context (started inside a
// traced init): the message's context carries it, and every such message
// became its child.
func TestMessagesWithoutOrWithBadTraceContextStartNewTraces(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := pgoutboxtest.PubSub(t)
	exp, tp, tracing := newTracing(t)

	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddMiddleware(tracing.Middleware)
	var handled atomic.Int32
	router.AddConsumerHandler("plain", "plain", env.Subscriber, func(msg *message.Message) error {
		require.False(t, trace.SpanContextFromContext(msg.Context()).IsRemote())
		handled.Add(1)
		return nil
	})
	runUnderSpan(t, tp, router)

	pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(env.Pool), pgoutbox.PublisherConfig{Tables: env.Tables, PublishHook: tracing}, nil)
	require.NoError(t, err)
	plain := message.NewMessage(watermill.NewUUID(), []byte("no span"))
	bad := message.NewMessage(watermill.NewUUID(), []byte("bad"))
	bad.Metadata.Set("traceparent", "00-not-a-trace-id-01")
	bad.Metadata.Set("baggage", "%%%")
	require.NoError(t, pub.Publish("plain", plain, bad))
	require.Empty(t, plain.Metadata.Get("traceparent"), "no span, nothing written")

	got := spans(t, exp, "process plain", 2)
	for _, s := range got {
		require.False(t, s.Parent.IsValid(), "a span of a new trace")
		require.Equal(t, codes.Unset, s.Status.Code)
	}
	require.NotEqual(t, got[0].SpanContext.TraceID(), got[1].SpanContext.TraceID())
	require.Eventually(t, func() bool {
		var n int
		require.NoError(t, env.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox`).Scan(&n))
		return n == 0
	}, 10*time.Second, 5*time.Millisecond, "both acked")
	require.EqualValues(t, 2, handled.Load())
}

// The same on a Router whose subscriber is not pgoutbox's: GoChannel's
// messages carry the context Subscribe was given, the Router's run span
// among its values, and a message without trace context joined it.
func TestMessagesOfAnotherSubscriberWithoutTraceContextStartNewTraces(t *testing.T) {
	t.Parallel()
	exp, tp, tracing := newTracing(t)
	broker := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16, Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = broker.Close() })

	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddMiddleware(tracing.Middleware)
	router.AddConsumerHandler("plain", "plain", broker, func(*message.Message) error { return nil })
	runUnderSpan(t, tp, router)

	bad := message.NewMessage(watermill.NewUUID(), []byte("bad"))
	bad.Metadata.Set("traceparent", "not-a-traceparent")
	require.NoError(t, broker.Publish("plain", message.NewMessage(watermill.NewUUID(), []byte("no span")), bad))
	for _, s := range spans(t, exp, "process plain", 2) {
		require.False(t, s.Parent.IsValid(), "a span of a new trace, not of the Router's run span")
	}
}

// The hook writes the message's own span when it has one, else the
// call's; the propagator can be replaced.
func TestPublishHookPrefersTheMessagesOwnSpan(t *testing.T) {
	t.Parallel()
	tp := sdktrace.NewTracerProvider()
	tracing := pgoutboxotel.NewTracing(pgoutboxotel.TracingOptions{TracerProvider: tp, Propagator: propagation.TraceContext{}})
	callCtx, call := tp.Tracer("t").Start(context.Background(), "call")
	ownCtx, own := tp.Tracer("t").Start(context.Background(), "own")
	withOwn := message.NewMessage("1", nil)
	withOwn.SetContext(ownCtx)
	without := message.NewMessage("2", nil)
	tracing.BeforePublish(callCtx, "t", withOwn)
	tracing.BeforePublish(callCtx, "t", without)
	read := func(m *message.Message) trace.SpanContext {
		return trace.SpanContextFromContext(propagation.TraceContext{}.Extract(context.Background(), propagation.MapCarrier(m.Metadata)))
	}
	require.Equal(t, own.SpanContext().SpanID(), read(withOwn).SpanID())
	require.Equal(t, call.SpanContext().SpanID(), read(without).SpanID())
}

// A message built as a struct literal has no metadata map: the hook makes
// one rather than panic in the publisher's goroutine.
func TestPublishHookGivesAMessageWithoutMetadataItsTraceContext(t *testing.T) {
	t.Parallel()
	tp := sdktrace.NewTracerProvider()
	tracing := pgoutboxotel.NewTracing(pgoutboxotel.TracingOptions{TracerProvider: tp, Propagator: propagation.TraceContext{}})
	callCtx, call := tp.Tracer("t").Start(context.Background(), "call")
	bare := &message.Message{UUID: "1"}
	require.NotPanics(t, func() { tracing.BeforePublish(callCtx, "t", bare) })
	got := trace.SpanContextFromContext(propagation.TraceContext{}.Extract(context.Background(), propagation.MapCarrier(bare.Metadata)))
	require.Equal(t, call.SpanContext().SpanID(), got.SpanID())
}

// The trace context stays in the row through a dead letter and a requeue:
// the rejected delivery and the one after the requeue are both children
// of the publishing span.
func TestTraceSurvivesADeadLetterAndARequeue(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := pgoutboxtest.PubSub(t)
	exp, tp, tracing := newTracing(t)

	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddMiddleware(tracing.Middleware, pgoutbox.ErrorRecorder)
	var calls atomic.Int32
	router.AddConsumerHandler("once", "dlq", env.Subscriber, func(msg *message.Message) error {
		if calls.Add(1) == 1 {
			return pgoutbox.Reject(msg, "not yet")
		}
		return nil
	})
	runCtx, stop := context.WithCancel(ctx)
	t.Cleanup(stop)
	go func() { _ = router.Run(runCtx) }()
	<-router.Running()

	pubCtx, span := tp.Tracer("t").Start(ctx, "publish")
	pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(env.Pool), pgoutbox.PublisherConfig{Tables: env.Tables, PublishHook: tracing}, nil)
	require.NoError(t, err)
	m := message.NewMessage(watermill.NewUUID(), []byte("x"))
	m.SetContext(pubCtx)
	require.NoError(t, pub.Publish("dlq", m))
	span.End()

	spans(t, exp, "process dlq", 1)
	require.Eventually(t, func() bool {
		n, err := pgoutbox.RequeueDeadLettersMatching(ctx, env.Exec(), env.Tables, pgoutbox.DeadLetterFilter{Topic: "dlq"})
		require.NoError(t, err)
		return n == 1
	}, 10*time.Second, 5*time.Millisecond, "the rejected message is dead-lettered")
	got := spans(t, exp, "process dlq", 2)
	require.Equal(t, codes.Error, got[0].Status.Code)
	require.Equal(t, "rejected", attrsOf(got[0])[semconv.ErrorTypeKey].AsString(), "not the type Reject wraps the error in")
	for _, s := range got {
		requireChildOf(t, s, span.SpanContext())
		require.EqualValues(t, 1, attrsOf(s)[pgoutboxotel.DeliveryAttemptKey].AsInt64(), "a requeue starts the count again")
	}
}
