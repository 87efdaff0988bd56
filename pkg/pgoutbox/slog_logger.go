package pgoutbox

import (
	"context"
	"log/slog"
	"sort"

	"github.com/ThreeDotsLabs/watermill"
)

// SlogLogger is a watermill.LoggerAdapter over a *slog.Logger that logs at
// the levels pgoutbox means: its warnings (a lost lease, a parked row) are
// slog.LevelWarn records, where Watermill's own slog adapter, which has no
// warning level, gives them as INFO with severity=warn and a handler set
// to LevelWarn drops them. Errors are LevelError records with the error
// under "error", Watermill's trace level is watermill.LevelTrace. Give it
// to the Router, publishers and subscribers alike.
type SlogLogger struct {
	l *slog.Logger
}

var _ watermill.LoggerAdapter = (*SlogLogger)(nil)

// NewSlogLogger returns a SlogLogger writing to l; nil means slog.Default().
func NewSlogLogger(l *slog.Logger) *SlogLogger {
	if l == nil {
		l = slog.Default()
	}
	return &SlogLogger{l: l}
}

// Error logs at slog.LevelError, with err under "error".
func (s *SlogLogger) Error(msg string, err error, fields watermill.LogFields) {
	s.log(slog.LevelError, msg, fields, slog.Any("error", err))
}

// Warn logs at slog.LevelWarn.
func (s *SlogLogger) Warn(msg string, fields watermill.LogFields) {
	s.log(slog.LevelWarn, msg, fields)
}

// Info logs at slog.LevelInfo.
func (s *SlogLogger) Info(msg string, fields watermill.LogFields) {
	s.log(slog.LevelInfo, msg, fields)
}

// Debug logs at slog.LevelDebug.
func (s *SlogLogger) Debug(msg string, fields watermill.LogFields) {
	s.log(slog.LevelDebug, msg, fields)
}

// Trace logs at watermill.LevelTrace (below slog.LevelDebug).
func (s *SlogLogger) Trace(msg string, fields watermill.LogFields) {
	s.log(watermill.LevelTrace, msg, fields)
}

// With returns a SlogLogger that adds fields to every record.
func (s *SlogLogger) With(fields watermill.LogFields) watermill.LoggerAdapter {
	attrs := attrsOf(fields, nil)
	args := make([]any, len(attrs))
	for i, a := range attrs {
		args[i] = a
	}
	return &SlogLogger{l: s.l.With(args...)}
}

func (s *SlogLogger) log(level slog.Level, msg string, fields watermill.LogFields, extra ...slog.Attr) {
	ctx := context.Background()
	if !s.l.Enabled(ctx, level) {
		return // no attributes built for a record nobody wants
	}
	s.l.LogAttrs(ctx, level, msg, append(attrsOf(fields, make([]slog.Attr, 0, len(fields)+len(extra))), extra...)...)
}

// attrsOf appends fields to dst as slog attributes, sorted by key so
// records read the same every time (a map has no order).
func attrsOf(fields watermill.LogFields, dst []slog.Attr) []slog.Attr {
	keys := make([]string, 0, len(fields))
	for k := range fields {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		dst = append(dst, slog.Any(k, fields[k]))
	}
	return dst
}
