package pgoutbox_test

import (
	"bytes"
	"errors"
	"log/slog"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
)

// Each method logs at its own slog level, with the fields sorted, the
// error under "error", and With's fields on every record; a handler's
// level applies.
func TestSlogLoggerLevels(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	h := slog.NewTextHandler(&buf, &slog.HandlerOptions{
		Level: watermill.LevelTrace,
		ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
			if a.Key == slog.TimeKey {
				return slog.Attr{}
			}
			return a
		},
	})
	l := pgoutbox.NewSlogLogger(slog.New(h)).With(watermill.LogFields{"topic": "orders"})
	w, ok := l.(interface {
		Warn(string, watermill.LogFields)
	})
	require.True(t, ok, "With keeps the Warn method, which pgoutbox looks for")
	l.Error("failed", errors.New("boom"), watermill.LogFields{"row_id": 7, "b": 1, "a": 2})
	w.Warn("lease lost", watermill.LogFields{"row_id": 8})
	l.Info("info", nil)
	l.Debug("debug", nil)
	l.Trace("trace", nil)
	require.Equal(t, strings.Join([]string{
		`level=ERROR msg=failed topic=orders a=2 b=1 row_id=7 error=boom`,
		`level=WARN msg="lease lost" topic=orders row_id=8`,
		`level=INFO msg=info topic=orders`,
		`level=DEBUG msg=debug topic=orders`,
		`level=DEBUG-4 msg=trace topic=orders`,
		``,
	}, "\n"), buf.String())

	buf.Reset()
	warnOnly := pgoutbox.NewSlogLogger(slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelWarn})))
	warnOnly.Info("dropped", watermill.LogFields{"x": 1})
	warnOnly.Warn("kept", nil)
	require.Contains(t, buf.String(), "level=WARN msg=kept")
	require.NotContains(t, buf.String(), "dropped")
}
