// grpc-backend is the gRPC server behind the proxies in the gRPC scenarios.
//
// It echoes every message it receives on any method until the client
// half-closes, so one handler serves both unary calls (one message in, one
// out) and bidirectional streams. It never decodes the payload: a raw codec
// keeps the backend's own cost tiny and equal for every proxy under test.
// ghz describes the calls with echo.proto next to this file.
//
// With -check ADDR it is instead the client that proves a proxy routes gRPC
// correctly: one unary call and one bidi stream, each echo compared byte for byte.
package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"os"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// frame is one undecoded gRPC message.
type frame struct{ b []byte }

// rawCodec passes message bytes through untouched. It is registered under the
// name "proto" so clients sending application/grpc (+proto) are served by it.
type rawCodec struct{}

func (rawCodec) Marshal(v any) ([]byte, error) {
	f, ok := v.(*frame)
	if !ok {
		return nil, fmt.Errorf("raw codec cannot marshal %T", v)
	}
	return f.b, nil
}

func (rawCodec) Unmarshal(data []byte, v any) error {
	f, ok := v.(*frame)
	if !ok {
		return fmt.Errorf("raw codec cannot unmarshal into %T", v)
	}
	f.b = append(f.b[:0], data...)
	return nil
}

func (rawCodec) Name() string { return "proto" }

func echo(_ any, stream grpc.ServerStream) error {
	var f frame
	for {
		if err := stream.RecvMsg(&f); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		if err := stream.SendMsg(&f); err != nil {
			return err
		}
	}
}

// msg is a bench.Msg{payload} encoded by hand (field 1, bytes) so the check
// needs no generated code.
func msg(payload string) []byte {
	return append([]byte{0x0a, byte(len(payload))}, payload...)
}

func check(addr string) error {
	conn, err := grpc.NewClient(addr,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.ForceCodec(rawCodec{})))
	if err != nil {
		return fmt.Errorf("cannot dial %s: %w", addr, err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()

	want := msg("unary-check")
	var got frame
	if err := conn.Invoke(ctx, "/bench.Echo/Unary", &frame{want}, &got); err != nil {
		return fmt.Errorf("unary call through %s failed: %w", addr, err)
	}
	if !bytes.Equal(got.b, want) {
		return fmt.Errorf("unary echo through %s differs: sent %q, got %q", addr, want, got.b)
	}

	desc := &grpc.StreamDesc{StreamName: "Bidi", ServerStreams: true, ClientStreams: true}
	st, err := conn.NewStream(ctx, desc, "/bench.Echo/Bidi")
	if err != nil {
		return fmt.Errorf("opening a bidi stream through %s failed: %w", addr, err)
	}
	for i := 0; i < 3; i++ {
		want := msg(fmt.Sprintf("stream-check-%d", i))
		if err := st.SendMsg(&frame{want}); err != nil {
			return fmt.Errorf("bidi send %d through %s failed: %w", i, addr, err)
		}
		var got frame
		if err := st.RecvMsg(&got); err != nil {
			return fmt.Errorf("bidi receive %d through %s failed: %w", i, addr, err)
		}
		if !bytes.Equal(got.b, want) {
			return fmt.Errorf("bidi echo %d through %s differs: sent %q, got %q", i, addr, want, got.b)
		}
	}
	if err := st.CloseSend(); err != nil {
		return fmt.Errorf("bidi half-close through %s failed: %w", addr, err)
	}
	var extra frame
	if err := st.RecvMsg(&extra); !errors.Is(err, io.EOF) {
		return fmt.Errorf("bidi stream through %s did not end cleanly with status OK: %v", addr, err)
	}
	return nil
}

func main() {
	addr := flag.String("addr", "127.0.0.1:18090", "address to listen on (loopback only)")
	checkAddr := flag.String("check", "", "instead of serving, check that ADDR echoes unary and bidi calls correctly")
	flag.Parse()
	if *checkAddr != "" {
		if err := check(*checkAddr); err != nil {
			fmt.Fprintf(os.Stderr, "grpc check failed: %v\n", err)
			os.Exit(1)
		}
		fmt.Println("grpc check ok: unary and bidi echo")
		return
	}
	lis, err := net.Listen("tcp", *addr)
	if err != nil {
		fmt.Fprintf(os.Stderr, "grpc-backend: cannot listen on %s: %v (is another backend still running? pick a free port with -addr)\n", *addr, err)
		os.Exit(1)
	}
	srv := grpc.NewServer(
		grpc.ForceServerCodec(rawCodec{}),
		grpc.UnknownServiceHandler(echo),
		grpc.MaxConcurrentStreams(1000),
	)
	log.Printf("grpc-backend echoing on %s", *addr)
	if err := srv.Serve(lis); err != nil {
		fmt.Fprintf(os.Stderr, "grpc-backend: serve: %v\n", err)
		os.Exit(1)
	}
}
