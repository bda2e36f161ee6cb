// xds-test-server: a go-control-plane xDS server (ADS, SotW and delta) driven over stdin, for
// flatmesh's interop tests (crates/xds/tests/go_control_plane.rs).
//
// It prints {"event":"listening","addr":"127.0.0.1:PORT"} once, then one JSON line per request
// the node sends ({"event":"request","delta":false,"type":"CDS","version":"2","nonce":"3","error":""}),
// so a test sees the real ACKs and NACKs. Each stdin line is a JSON snapshot (see Snapshot
// below) that replaces what the node is served ({"event":"snapshot"} confirms it); "quit"
// stops the server.
//
// Built by the tests with `go build -mod=readonly`: the committed go.sum must be complete, and
// the module proxy is used only to download what it pins.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"time"

	cluster "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpoint "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listener "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	route "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	router "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	hcm "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	tcpproxy "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/tcp_proxy/v3"
	discoverygrpc "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

type Snapshot struct {
	Version   string        `json:"version"`
	Listeners []ListenerDef `json:"listeners"`
	Routes    []RouteDef    `json:"routes"`
	Clusters  []ClusterDef  `json:"clusters"`
	Endpoints []EndpointDef `json:"endpoints"`
}

type ListenerDef struct {
	Name       string `json:"name"`
	Port       uint32 `json:"port"`
	Rds        string `json:"rds"`
	TCPCluster string `json:"tcp_cluster"`
}

type RouteDef struct {
	Name   string     `json:"name"`
	Vhosts []VhostDef `json:"vhosts"`
}

type VhostDef struct {
	Name    string        `json:"name"`
	Domains []string      `json:"domains"`
	Routes  []RouteRowDef `json:"routes"`
}

type RouteRowDef struct {
	Prefix   string            `json:"prefix"`
	Cluster  string            `json:"cluster"`
	Weighted map[string]uint32 `json:"weighted"`
	Status   uint32            `json:"status"`
	Header   string            `json:"header"` // exact match "name=value"
}

type ClusterDef struct {
	Name    string   `json:"name"`
	Lb      string   `json:"lb"`
	Static  []string `json:"static"`
	Unsupported bool `json:"unsupported"` // sets upstream_connection_options, which flatmesh must NACK
}

type EndpointDef struct {
	Cluster string   `json:"cluster"`
	Addrs   []string `json:"addrs"`
}

var out = struct {
	sync.Mutex
	w *bufio.Writer
}{w: bufio.NewWriter(os.Stdout)}

func emit(v any) {
	b, _ := json.Marshal(v)
	out.Lock()
	defer out.Unlock()
	out.w.Write(b)
	out.w.WriteString("\n")
	out.w.Flush()
}

func short(typeURL string) string {
	switch typeURL {
	case resource.ListenerType:
		return "LDS"
	case resource.RouteType:
		return "RDS"
	case resource.ClusterType:
		return "CDS"
	case resource.EndpointType:
		return "EDS"
	}
	return typeURL
}

func addr(hostport string) *core.Address {
	host, port, err := net.SplitHostPort(hostport)
	if err != nil {
		panic(err)
	}
	var p uint32
	fmt.Sscan(port, &p)
	return &core.Address{Address: &core.Address_SocketAddress{SocketAddress: &core.SocketAddress{
		Address: host, PortSpecifier: &core.SocketAddress_PortValue{PortValue: p}}}}
}

func build(s Snapshot) map[resource.Type][]types.Resource {
	res := map[resource.Type][]types.Resource{}
	for _, l := range s.Listeners {
		var f *listener.Filter
		if l.TCPCluster != "" {
			cfg, _ := anypb.New(&tcpproxy.TcpProxy{StatPrefix: l.Name,
				ClusterSpecifier: &tcpproxy.TcpProxy_Cluster{Cluster: l.TCPCluster}})
			f = &listener.Filter{Name: "envoy.filters.network.tcp_proxy", ConfigType: &listener.Filter_TypedConfig{TypedConfig: cfg}}
		} else {
			routerCfg, _ := anypb.New(&router.Router{})
			cfg, _ := anypb.New(&hcm.HttpConnectionManager{
				StatPrefix: l.Name,
				RouteSpecifier: &hcm.HttpConnectionManager_Rds{Rds: &hcm.Rds{
					RouteConfigName: l.Rds,
					ConfigSource: &core.ConfigSource{ResourceApiVersion: core.ApiVersion_V3,
						ConfigSourceSpecifier: &core.ConfigSource_Ads{Ads: &core.AggregatedConfigSource{}}},
				}},
				HttpFilters: []*hcm.HttpFilter{{Name: "envoy.filters.http.router",
					ConfigType: &hcm.HttpFilter_TypedConfig{TypedConfig: routerCfg}}},
			})
			f = &listener.Filter{Name: "envoy.filters.network.http_connection_manager", ConfigType: &listener.Filter_TypedConfig{TypedConfig: cfg}}
		}
		res[resource.ListenerType] = append(res[resource.ListenerType], &listener.Listener{
			Name:         l.Name,
			Address:      addr(fmt.Sprintf("127.0.0.1:%d", l.Port)),
			FilterChains: []*listener.FilterChain{{Filters: []*listener.Filter{f}}},
		})
	}
	for _, r := range s.Routes {
		rc := &route.RouteConfiguration{Name: r.Name}
		for _, v := range r.Vhosts {
			vh := &route.VirtualHost{Name: v.Name, Domains: v.Domains}
			for _, row := range v.Routes {
				rt := &route.Route{Match: &route.RouteMatch{PathSpecifier: &route.RouteMatch_Prefix{Prefix: row.Prefix}}}
				if row.Header != "" {
					kv := strings.SplitN(row.Header, "=", 2)
					rt.Match.Headers = []*route.HeaderMatcher{{Name: kv[0],
						HeaderMatchSpecifier: &route.HeaderMatcher_ExactMatch{ExactMatch: kv[1]}}}
				}
				switch {
				case row.Status != 0:
					rt.Action = &route.Route_DirectResponse{DirectResponse: &route.DirectResponseAction{Status: row.Status}}
				case len(row.Weighted) > 0:
					wc := &route.WeightedCluster{}
					for name, w := range row.Weighted {
						wc.Clusters = append(wc.Clusters, &route.WeightedCluster_ClusterWeight{Name: name, Weight: wrapperspb.UInt32(w)})
					}
					rt.Action = &route.Route_Route{Route: &route.RouteAction{ClusterSpecifier: &route.RouteAction_WeightedClusters{WeightedClusters: wc}}}
				default:
					rt.Action = &route.Route_Route{Route: &route.RouteAction{ClusterSpecifier: &route.RouteAction_Cluster{Cluster: row.Cluster}}}
				}
				vh.Routes = append(vh.Routes, rt)
			}
			rc.VirtualHosts = append(rc.VirtualHosts, vh)
		}
		res[resource.RouteType] = append(res[resource.RouteType], rc)
	}
	for _, c := range s.Clusters {
		cl := &cluster.Cluster{Name: c.Name, ConnectTimeout: durationpb.New(time.Second)}
		if c.Lb != "" {
			cl.LbPolicy = cluster.Cluster_LbPolicy(cluster.Cluster_LbPolicy_value[c.Lb])
		}
		if c.Unsupported {
			cl.UpstreamConnectionOptions = &cluster.UpstreamConnectionOptions{}
		}
		if c.Static != nil {
			cl.ClusterDiscoveryType = &cluster.Cluster_Type{Type: cluster.Cluster_STATIC}
			cl.LoadAssignment = assignment(c.Name, c.Static)
		} else {
			cl.ClusterDiscoveryType = &cluster.Cluster_Type{Type: cluster.Cluster_EDS}
			cl.EdsClusterConfig = &cluster.Cluster_EdsClusterConfig{EdsConfig: &core.ConfigSource{
				ResourceApiVersion:    core.ApiVersion_V3,
				ConfigSourceSpecifier: &core.ConfigSource_Ads{Ads: &core.AggregatedConfigSource{}}}}
		}
		res[resource.ClusterType] = append(res[resource.ClusterType], cl)
	}
	for _, e := range s.Endpoints {
		res[resource.EndpointType] = append(res[resource.EndpointType], assignment(e.Cluster, e.Addrs))
	}
	return res
}

func assignment(name string, addrs []string) *endpoint.ClusterLoadAssignment {
	lbs := []*endpoint.LbEndpoint{}
	for _, a := range addrs {
		lbs = append(lbs, &endpoint.LbEndpoint{HostIdentifier: &endpoint.LbEndpoint_Endpoint{Endpoint: &endpoint.Endpoint{Address: addr(a)}}})
	}
	return &endpoint.ClusterLoadAssignment{ClusterName: name, Endpoints: []*endpoint.LocalityLbEndpoints{{LbEndpoints: lbs}}}
}

func main() {
	listen := flag.String("addr", "127.0.0.1:0", "address to serve ADS on")
	node := flag.String("node", "node-1", "node id the snapshots are for")
	flag.Parse()

	ctx := context.Background()
	snapshots := cache.NewSnapshotCache(true, cache.IDHash{}, nil)
	callbacks := server.CallbackFuncs{
		StreamRequestFunc: func(id int64, req *discoverygrpc.DiscoveryRequest) error {
			emit(map[string]any{"event": "request", "delta": false, "type": short(req.TypeUrl),
				"version": req.VersionInfo, "nonce": req.ResponseNonce, "names": req.ResourceNames,
				"error": req.GetErrorDetail().GetMessage()})
			return nil
		},
		StreamDeltaRequestFunc: func(id int64, req *discoverygrpc.DeltaDiscoveryRequest) error {
			emit(map[string]any{"event": "request", "delta": true, "type": short(req.TypeUrl),
				"nonce": req.ResponseNonce, "names": req.ResourceNamesSubscribe,
				"error": req.GetErrorDetail().GetMessage()})
			return nil
		},
	}
	srv := server.NewServer(ctx, snapshots, callbacks)
	grpcServer := grpc.NewServer(grpc.MaxRecvMsgSize(64<<20), grpc.MaxSendMsgSize(64<<20))
	discoverygrpc.RegisterAggregatedDiscoveryServiceServer(grpcServer, srv)
	lis, err := net.Listen("tcp", *listen)
	if err != nil {
		fmt.Fprintln(os.Stderr, "listen:", err)
		os.Exit(1)
	}
	emit(map[string]any{"event": "listening", "addr": lis.Addr().String()})
	go grpcServer.Serve(lis)

	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 256<<20)
	for in.Scan() {
		line := strings.TrimSpace(in.Text())
		if line == "" {
			continue
		}
		if line == "quit" {
			break
		}
		var s Snapshot
		if err := json.Unmarshal([]byte(line), &s); err != nil {
			emit(map[string]any{"event": "error", "error": err.Error()})
			continue
		}
		snap, err := cache.NewSnapshot(s.Version, build(s))
		if err == nil {
			err = snapshots.SetSnapshot(ctx, *node, snap)
		}
		if err != nil {
			emit(map[string]any{"event": "error", "error": err.Error()})
			continue
		}
		emit(map[string]any{"event": "snapshot", "version": s.Version})
	}
	grpcServer.Stop()
}
